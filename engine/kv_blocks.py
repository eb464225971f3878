"""The KV cache's blocks: which are free, which tokens each one holds, how many sequences hold it.

A sequence's KV cache is a list of blocks of `size` positions (its block table); the backend's cache stores every
block's keys and values ([n_blocks, size, n_kv, head_dim] per layer), and attention reads a sequence's positions
through its table. A block records the tokens whose keys and values it holds, and the digest of all tokens before
it, so a new prompt finds the blocks that already hold its prefix:

- a full block is keyed by a digest of every token up to and including it; a prompt walks its full blocks' keys and
  shares every block it finds (reference counts; a full block is never written again);
- after the last shared full block, the block holding the most of the prompt's next tokens (same digest before it)
  is taken over (when nothing else it holds is lost) or copied up to there: the prompt's partial block is its own.

Blocks nobody holds stay cached, least recently released first out (their keys die with their contents). A backend
whose attention reads one contiguous cache per sequence gets blocks of a whole context: one block per sequence, never
shared, its prefix caching all copies and take-overs.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

KV_BLOCK_SIZE = 16       # positions per block of a paged KV cache
ROOT = b""               # the digest before a sequence's first token


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens a and b share, at most limit."""
    m = min(len(a), len(b), limit)
    if m <= 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The digest of a prefix: the one before a block's tokens, then those tokens."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Free lists, reference counts and the contents index of n_blocks KV blocks of `size` positions.
    caching=False: a released block forgets what it held (no prefix caching)."""

    def __init__(self, n_blocks: int, size: int, caching: bool = True):
        self.n_blocks, self.size, self.caching = n_blocks, size, caching
        self.ref = np.zeros(n_blocks, np.int32)                   # [n_blocks] sequences holding each block
        self.ids = np.zeros((n_blocks, size), np.int32)           # [n_blocks, size] the tokens each block holds
        self.length = np.zeros(n_blocks, np.int32)                # [n_blocks] how many of them
        self.parent: list[bytes | None] = [None] * n_blocks       # digest before each block's tokens (None: empty)
        self.key: list[bytes | None] = [None] * n_blocks          # a full block's digest through its tokens
        self.full: dict[bytes, int] = {}                          # digest -> a full block holding that prefix
        self.children: dict[bytes, set[int]] = {}                 # digest -> blocks holding tokens right after it
        self.empty: deque[int] = deque(range(n_blocks))           # free blocks that hold nothing
        self.cached: OrderedDict[int, None] = OrderedDict()       # free blocks with contents, least recent first
        # what match() last walked: the tokens, the digests of their first full blocks (keys[j]: through block j), the
        # full blocks it found, and self.removals then (a block found stays the one a key finds until a key is removed)
        self._walked: tuple[np.ndarray, list[bytes], list[int], int] = (np.zeros(0, np.int32), [], [], 0)
        self.removals = 0                                         # keys taken out of self.full so far

    # -- free blocks --------------------------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Blocks a sequence can be given (empty, or cached and evicted on the way)."""
        return len(self.empty) + len(self.cached)

    def next_free(self) -> int:
        """The block allocate() gives next."""
        if self.empty:
            return self.empty[0]
        if self.cached:
            return next(iter(self.cached))
        raise OutOfBlocks("no free KV block")

    def allocate(self) -> int:
        """A free block, emptied (the least recently released cached one when none is empty), held once."""
        b = self.next_free()
        if self.empty and self.empty[0] == b:
            self.empty.popleft()
        else:
            del self.cached[b]
            self._forget(b)
        self.ref[b] = 1
        return b

    def hold(self, b: int) -> None:
        """One more sequence holds block b (a shared prefix block, or a free one taken over)."""
        if self.ref[b] == 0:
            self._unfree(b)
        self.ref[b] += 1

    def hold_all(self, blocks: list[int]) -> None:
        """hold(b) for each of blocks (distinct: a prefix's full blocks), the counts in one numpy step."""
        idx = np.asarray(blocks, np.int64)
        for b in idx[self.ref[idx] == 0]:
            self._unfree(int(b))
        self.ref[idx] += 1

    def _unfree(self, b: int) -> None:
        if b in self.cached:
            del self.cached[b]
        else:
            self.empty.remove(b)

    def release(self, b: int) -> None:
        """A sequence lets go of block b; nobody holding it, it stays cached with its contents (or is emptied)."""
        self.ref[b] -= 1
        if self.ref[b] > 0:
            return
        if self.caching and self.length[b] > 0:
            self.cached[b] = None
            if self.key[b] is not None:
                self.full.setdefault(self.key[b], b)      # a copy of an indexed block's prefix: kept findable
        else:
            self._forget(b)
            self.empty.append(b)

    # -- contents -----------------------------------------------------------------------------------------------
    def _forget(self, b: int) -> None:
        self._forget_key(b)
        if self.parent[b] is not None:
            self.children[self.parent[b]].discard(b)
            if not self.children[self.parent[b]]:
                del self.children[self.parent[b]]
        self.parent[b] = None
        self.length[b] = 0

    def write(self, b: int, parent: bytes, start: int, tokens) -> bytes | None:
        """Block b (held by one sequence) now holds tokens at positions start.. of the block (what it held from start
        on is gone), after the prefix whose digest is parent -> the block's key once it is full, else None."""
        end = start + len(tokens)
        if start < self.length[b]:                                      # a full block written over: its key goes
            self._forget_key(b)
        if self.parent[b] != parent:
            self._forget(b)
            self.parent[b] = parent
            self.children.setdefault(parent, set()).add(b)
        self.ids[b, start:end] = tokens
        self.length[b] = end
        return self._seal(b) if end == self.size else None

    def append(self, blocks: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """One token more in each of blocks (distinct, each held by one sequence and holding offsets[i] tokens after
        its digest's prefix): a decode step's, in one go."""
        self.ids[blocks, offsets] = tokens
        self.length[blocks] = offsets + 1
        for b in blocks[offsets + 1 == self.size]:
            self._seal(int(b))

    def _seal(self, b: int) -> bytes:
        """Block b is full: its key, findable by it (unless another block already holds that prefix)."""
        key = self.key[b] = block_key(self.parent[b], self.ids[b])
        self.full.setdefault(key, b)
        return key

    def _forget_key(self, b: int) -> None:
        """Block b's tokens are no longer a full block's: its key goes (and its index entry, if it is the one)."""
        if self.key[b] is not None and self.full.get(self.key[b]) == b:
            del self.full[self.key[b]]
            self.removals += 1
        self.key[b] = None

    def copy(self, src: int, dst: int, n: int) -> None:
        """Block dst (fresh) now holds the first n tokens of block src (the backend's cache copied them)."""
        self.write(dst, self.parent[src], 0, self.ids[src, :n])

    def truncate(self, b: int, n: int) -> None:
        """Block b (just taken over) keeps its first n tokens."""
        if n < self.length[b]:
            self._forget_key(b)
            self.length[b] = n

    # -- prefixes -----------------------------------------------------------------------------------------------
    def match(self, tokens: np.ndarray, limit: int) -> tuple[list[int], int, int]:
        """The cache's longest hold on tokens[:limit] -> (full blocks holding its first len * size tokens, the block
        holding the most of the next ones (-1: none), how many of them it holds)."""
        limit = min(limit, len(tokens))
        if not self.caching:
            return [], -1, 0
        blocks, keys = self._walk(tokens, limit // self.size)
        i, parent = len(blocks) * self.size, keys[len(blocks) - 1] if blocks else ROOT
        kids, m = self.children.get(parent), min(self.size, limit - i)
        if not kids or m <= 0:
            return blocks, -1, 0
        # the children's common prefixes with the next tokens, all at once (a shared system prompt's last full block
        # gathers a child per request that followed it: hundreds, scanned one by one at ~2 us each per admission)
        cand = np.fromiter(kids, np.int64, len(kids))                              # [n_kids]
        differ = np.concatenate([self.ids[cand, :m] != tokens[i:i + m], np.ones((len(cand), 1), bool)], axis=1)
        held = differ.argmax(axis=1)                  # [n_kids] leading matches: the first difference (cumprod: 2x)
        held = np.minimum(held, self.length[cand])
        j = int(np.argmax(held))                                                   # the first of the longest
        return (blocks, int(cand[j]), int(held[j])) if held[j] > 0 else (blocks, -1, 0)

    def _walk(self, tokens: np.ndarray, n_blocks: int) -> tuple[list[int], list[bytes]]:
        """The full blocks holding tokens' first blocks, up to n_blocks, and the digests made on the way (keys[j]:
        through block j; made as the walk needs them). What tokens share with the tokens walked last is not walked
        again: their digests are reused (a burst of prompts after one system text digests it once: 125 blocks of a
        2,000-token text took ~0.4 ms a request), and so are the blocks found for them while no key has left the
        index since (looking each of 125 digests up again took ~0.15 ms a request)."""
        if n_blocks <= 0:
            return [], []
        ids, known, found, removals = self._walked
        same = min(common_prefix(ids, tokens, n_blocks * self.size) // self.size, len(known))
        keys = known[:same]
        blocks = found[:min(same, len(found))] if removals == self.removals else []
        for j in range(len(blocks), n_blocks):
            if j == len(keys):
                keys.append(block_key(keys[-1] if keys else ROOT, tokens[j * self.size:(j + 1) * self.size]))
            b = self.full.get(keys[j])
            if b is None:
                break
            blocks.append(b)
        self._walked = (np.array(tokens[:n_blocks * self.size], np.int32), keys, blocks[:], self.removals)
        return blocks, keys

    def parent_of(self, table: list[int], j: int) -> bytes:
        """The digest before block j of a sequence's table (its blocks before j are full)."""
        return ROOT if j == 0 else self.key[table[j - 1]]


class TableRows:
    """Each sequence's block table as a numpy row [width] int32, kept between steps: a sequence's list of blocks only
    grows or is replaced by another list, so a step converts just the blocks added since the last one (converting
    every list each step cost 0.7 ms a step of 64 sequences at 256 blocks each, 3.8 ms at 2,048)."""

    def __init__(self, width: int):
        self.width = width
        self.rows: dict[int, tuple[list, np.ndarray, int]] = {}   # sequence -> (its list, row, blocks converted)

    def of(self, tables: dict) -> dict[int, np.ndarray]:
        """tables: sequence -> its list of blocks -> sequence -> its row (zeros past the list's length). Sequences not
        in tables are forgotten."""
        rows = {}
        for s, blocks in tables.items():
            hit = self.rows.get(s)
            if hit is None or hit[0] is not blocks or hit[2] > len(blocks):
                hit = (blocks, np.zeros(max(self.width, len(blocks)), np.int32), 0)
            _, row, n = hit
            if len(blocks) > len(row):
                row = np.concatenate([row[:n], np.zeros(len(blocks) - n, np.int32)])
            if len(blocks) > n:
                row[n:len(blocks)] = blocks[n:]
            rows[s] = (blocks, row, len(blocks))
        self.rows = rows
        return {s: row for s, (_, row, _) in rows.items()}
