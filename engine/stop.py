"""Stop strings over streamed text: never emit a stop string, even one split across tokens."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.word: str | None = None       # the stop string that matched

    def feed(self, text: str) -> str:
        """Add newly decoded text; returns what can be emitted now (text before a stop string, and nothing that
        could still turn out to begin one)."""
        if self.stopped:
            return ""
        full = self.pending + text
        hits = sorted((i, s) for s in self.stops if (i := full.find(s)) >= 0)
        if hits:
            self.stopped = True
            self.pending = ""
            self.word = hits[0][1]
            return full[:hits[0][0]]
        hold = 0
        for s in self.stops:   # the longest tail of `full` that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(full)), hold, -1):
                if full.endswith(s[:k]):
                    hold = k
                    break
        self.pending = full[len(full) - hold:] if hold else ""
        return full[:len(full) - hold]

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
