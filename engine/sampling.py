"""Token sampling: penalties, then top-k, top-p, min-p, temperature and a seeded draw (llama.cpp's chain order).

Temperature below GREEDY_BELOW is greedy (argmax after penalties): 1/T would overflow for subnormal temperatures,
and vLLM draws the same line. A seed is any integer; it is taken modulo 2**64 (the generator's range).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import functools
import math
import secrets

import numpy as np

GREEDY_BELOW = 1e-5           # temperatures under this are greedy
MAX_TEMPERATURE = 1e4         # above this the distribution is uniform to float precision; larger is refused
SEED_RANGE = 2 ** 64


class NonFiniteLogitsError(ValueError):
    """The logits hold NaN: the model's weights or activations are broken; nothing can be drawn from them."""


def seed_bits(seed: int | None) -> int | None:
    """Any integer seed mapped into the generator's range (negative seeds included, as OpenAI accepts them)."""
    return None if seed is None else int(seed) % SEED_RANGE


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40              # <= 0: off
    top_p: float = 0.95          # >= 1: off
    min_p: float = 0.05          # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def greedy_temperature(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError("top_p must be in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")


class Sampler:
    """One sequence's sampling: the parameters, a seed (drawn when none is given) and the draws made so far.

    Called with logits, it is the numpy reference; a backend's batched `sample` reads its parameters, `penalty_counts`
    and the (seed, draws) pair that keys its hashed draws."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.seed = seed_bits(params.seed) if params.seed is not None else secrets.randbits(64)
        self.draws = 0

    @functools.cached_property
    def rng(self) -> np.random.Generator:
        """The numpy reference's draws (made on first use: a generator costs ~30 us, a burst of requests sampled on
        the GPU never needs one)."""
        return np.random.default_rng(self.seed)

    @property
    def has_penalties(self) -> bool:
        p = self.p
        return p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def penalty_counts(self, history: list[int]) -> Counter | None:
        """How often each token occurs in the penalised window of history; None when no penalty applies."""
        if not history or not self.has_penalties:
            return None
        p = self.p
        return Counter(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history)

    @property
    def is_greedy(self) -> bool:
        """argmax of the raw logits: temperature 0 and no penalties (the backend may take the argmax itself)."""
        return self.p.greedy_temperature and not self.has_penalties

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.p
        counts = self.penalty_counts(history)
        if counts is None:
            return logits
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        freq = np.fromiter(counts.values(), np.float64, len(counts))
        logits = logits.astype(np.float64, copy=True)
        sel = logits[ids]
        if p.repeat_penalty != 1.0:
            sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel -= freq * p.frequency_penalty + p.presence_penalty
        logits[ids] = sel
        return logits

    def distribution(self, logits: np.ndarray, history: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The candidates (best first) and the probabilities a draw picks them with: penalties, top-k, top-p and
        min-p on the temperature-1 distribution, then softmax(x / temperature) over what is left."""
        p = self.p
        logits = self.apply_penalties(np.asarray(logits), history or []).astype(np.float64)
        if np.isnan(logits).any():
            raise NonFiniteLogitsError("the logits contain NaN (broken weights or an overflow in the model)")
        if p.greedy_temperature:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        n = len(logits)
        k = p.top_k if 0 < p.top_k < n else n
        cand = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
        cand = cand[np.argsort(-logits[cand], kind="stable")]          # candidates, best first
        probs = np.exp(logits[cand] - logits[cand[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            cand, probs = cand[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = max(1, int(np.sum(probs >= p.min_p * probs[0])))
            cand = cand[:keep]
        scaled = logits[cand] / p.temperature
        probs = np.exp(scaled - scaled.max())
        return cand, probs / probs.sum()

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """One token id from logits [n_vocab]."""
        cand, probs = self.distribution(logits, history)
        if self.p.greedy_temperature:
            return int(cand[0])
        return int(cand[self.rng.choice(len(cand), p=probs)])
