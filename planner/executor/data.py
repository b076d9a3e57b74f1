"""Training data: a seeded synthetic corpus (or a user's token file) and two batching modes.

- static: one document chunk per row, padded to seq_len (the conventional baseline).
- dynamic: token-budget batching with packing -- chunks are packed first-fit-decreasing
  into rows of seq_len inside a shuffle buffer, so a micro-batch carries up to
  micro_batch x seq_len real tokens; attention stays inside each document (segment ids)
  and positions restart per document.
Both draw the same document stream, cut documents longer than seq_len into chunks the same
way, and predict the same targets, so "real tokens" mean the same thing in both.

A row is (ids, position_ids, segment_ids, labels); labels are next tokens, IGNORE on
padding and at each chunk's last token (no prediction across documents).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.errors import SpecError

IGNORE = -100
BATCHING = ("static", "dynamic")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    seq_len: int
    vocab: int
    seed: int = 1234
    """Seeds the synthetic corpus (document lengths and tokens)."""
    mean_len: float = 0.0
    """Median document length of the synthetic log-normal distribution (0: seq_len / 3)."""
    sigma: float = 0.8
    """Log-normal shape: spread of document lengths."""
    min_len: int = 8
    token_file: str = ""
    """A .npy 1-D int array (documents split at eos_id) or a .txt with one document of
    whitespace-separated token ids per line; empty = synthetic."""
    eos_id: int = 0
    buffer: int = 64
    """Packing window: chunks considered together by first-fit-decreasing."""

    def __post_init__(self) -> None:
        if self.sigma < 0 or self.min_len < 2 or self.buffer < 1:
            raise SpecError("data", "sigma >= 0, min_len >= 2 and buffer >= 1 are required", "fix the data options")


class Corpus:
    """An endless deterministic stream of documents (token id arrays)."""

    def __init__(self, spec: DataSpec) -> None:
        self.spec = spec
        self._docs: list[np.ndarray] | None = None
        if spec.token_file:
            self._docs = _read_token_file(spec.token_file, spec.vocab, spec.eos_id)

    def doc(self, i: int) -> np.ndarray:
        if self._docs is not None:
            return self._docs[i % len(self._docs)]
        s = self.spec
        rng = np.random.default_rng((s.seed, i))
        median = s.mean_len or s.seq_len / 3
        n = int(np.clip(rng.lognormal(np.log(median), s.sigma), s.min_len, 4 * s.seq_len))
        # a learnable signal: a noisy affine walk over the vocabulary
        a, b = 1 + 2 * int(rng.integers(1, 8)), int(rng.integers(0, s.vocab))
        toks = np.empty(n, dtype=np.int64)
        toks[0] = rng.integers(1, s.vocab)
        noise = rng.random(n) < 0.1
        rand = rng.integers(1, s.vocab, size=n)
        for t in range(1, n):
            toks[t] = rand[t] if noise[t] else (a * toks[t - 1] + b) % s.vocab
        return toks


def _read_token_file(path: str, vocab: int, eos: int) -> list[np.ndarray]:
    p = Path(path)
    if not p.exists():
        raise SpecError("--data", f"{p} does not exist", "give a .npy or .txt token file")
    try:
        if p.suffix == ".npy":
            arr = np.load(p)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise SpecError("--data", f"{p} must hold a 1-D integer array", "save token ids with np.save")
            cuts = np.flatnonzero(arr == eos)
            docs = [d for d in np.split(arr.astype(np.int64), cuts + 1) if len(d) >= 2]
        else:
            docs = [np.array([int(t) for t in line.split()], dtype=np.int64)
                    for line in p.read_text().splitlines() if len(line.split()) >= 2]
    except ValueError as exc:
        raise SpecError("--data", f"cannot read {p}: {exc}", "one document of integer token ids per line") from None
    if not docs:
        raise SpecError("--data", f"{p} holds no document of 2+ tokens", "give a non-empty token file")
    top = max(int(d.max()) for d in docs)
    if top >= vocab or min(int(d.min()) for d in docs) < 0:
        raise SpecError("--data", f"token id {top} outside the model's vocabulary of {vocab}",
                        "tokenize with the model's tokenizer")
    return docs


def _chunks(corpus: Corpus, seq_len: int):
    """Documents cut into chunks of at most seq_len tokens, in stream order."""
    i = 0
    while True:
        d = corpus.doc(i)
        for start in range(0, len(d), seq_len):
            c = d[start:start + seq_len]
            if len(c) >= 2:
                yield c
        i += 1


class Rows:
    """The row stream of one batching mode, materialised on demand (deterministic)."""

    def __init__(self, spec: DataSpec, batching: str) -> None:
        if batching not in BATCHING:
            raise SpecError("--batching", f"unknown mode {batching!r}", "use static or dynamic")
        self.spec, self.batching = spec, batching
        self._chunks = _chunks(Corpus(spec), spec.seq_len)
        self._rows: list[list[np.ndarray]] = []

    def _grow(self) -> None:
        if self.batching == "static":
            self._rows.append([next(self._chunks)])
            return
        # first-fit decreasing over a window of chunks (Johnson 1973 bin packing heuristic)
        window = sorted((next(self._chunks) for _ in range(self.spec.buffer)), key=len, reverse=True)
        bins: list[list[np.ndarray]] = []
        free: list[int] = []
        for c in window:
            for j, f in enumerate(free):
                if len(c) <= f:
                    bins[j].append(c)
                    free[j] -= len(c)
                    break
            else:
                bins.append([c])
                free.append(self.spec.seq_len - len(c))
        self._rows.extend(bins)

    def row(self, i: int) -> list[np.ndarray]:
        while len(self._rows) <= i:
            self._grow()
        return self._rows[i]

    def tensors(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, position_ids, segment_ids (0 = padding), labels for row i."""
        s = self.spec.seq_len
        ids = np.zeros(s, np.int64)
        pos = np.zeros(s, np.int64)
        seg = np.zeros(s, np.int64)
        lab = np.full(s, IGNORE, np.int64)
        at = 0
        for k, c in enumerate(self.row(i), start=1):
            n = len(c)
            ids[at:at + n] = c
            pos[at:at + n] = np.arange(n)
            seg[at:at + n] = k
            lab[at:at + n - 1] = c[1:]
            at += n
        pos[at:] = np.arange(s - at)
        return ids, pos, seg, lab

    def real_tokens(self, i: int) -> int:
        return sum(len(c) for c in self.row(i))


@dataclass(frozen=True, slots=True)
class Layout:
    """Which rows a data-parallel rank reads: step t, micro-batch m, dp rank d."""

    micro_batch: int
    grad_accum: int
    dp: int

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def rows(self, batch: int, micro: int, dp_rank: int) -> range:
        start = batch * self.rows_per_step + (micro * self.dp + dp_rank) * self.micro_batch
        return range(start, start + self.micro_batch)


def padding_stats(rows: Rows, layout: Layout, batches: int) -> tuple[int, int]:
    """(real tokens, padding tokens) over the first `batches` global batches."""
    n = batches * layout.rows_per_step
    real = sum(rows.real_tokens(i) for i in range(n))
    return real, n * rows.spec.seq_len - real


def batches_for_tokens(rows: Rows, layout: Layout, tokens: int) -> int:
    """Fewest global batches whose real tokens reach `tokens`."""
    got, b = 0, 0
    while got < tokens:
        got += sum(rows.real_tokens(i) for i in range(b * layout.rows_per_step, (b + 1) * layout.rows_per_step))
        b += 1
    return b
