"""Batching of the training corpus (planner/data/corpus.py) into rows, and which rows a rank reads.

Batching modes:
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

import numpy as np

from planner.data.corpus import SPLITS, Corpus, DataSpec
from planner.errors import SpecError

IGNORE = -100
"""Label of padding and of each chunk's last token (torch's cross-entropy ignore_index)."""
BATCHING = ("static", "dynamic")


Chunk = tuple[int, int, int]
"""(document index in the split's stream, first token, tokens): a piece of a document."""


class Rows:
    """The row stream of one batching mode (deterministic). Packing is planned on document
    lengths alone (cheap, in order); a row's tokens are produced when asked for, so a Rows
    pickles small and DataLoader workers can produce rows in parallel."""

    def __init__(self, spec: DataSpec, batching: str, split: str = "train") -> None:
        if batching not in BATCHING:
            raise SpecError("--batching", f"unknown mode {batching!r}", "use static or dynamic")
        if split not in SPLITS:
            raise SpecError("split", f"unknown split {split!r}", "use train or eval")
        if split == "eval" and spec.eval_fraction == 0:
            raise SpecError("--data", "no held-out documents: eval_fraction is 0", "hold out a share, e.g. 0.05")
        self.spec, self.batching, self.split = spec, batching, split
        self.corpus = Corpus(spec, split)
        self._cursor = (0, 0)  # next chunk: document, first token
        self._rows: list[list[Chunk]] = []

    def _next_chunk(self) -> Chunk:
        """Documents cut into chunks of at most seq_len tokens (2+), in stream order."""
        d, start = self._cursor
        s = self.spec.seq_len
        while True:
            n = self.corpus.doc_len(d)
            while start < n:
                c = min(s, n - start)
                at, start = start, start + s
                if c >= 2:
                    self._cursor = (d, start)
                    return d, at, c
            d, start = d + 1, 0

    def _grow(self) -> None:
        if self.batching == "static":
            self._rows.append([self._next_chunk()])
            return
        # first-fit decreasing over a window of chunks (Johnson 1973 bin packing heuristic)
        window = sorted((self._next_chunk() for _ in range(self.spec.buffer)), key=lambda c: c[2], reverse=True)
        bins: list[list[Chunk]] = []
        free: list[int] = []
        for c in window:
            for j, f in enumerate(free):
                if c[2] <= f:
                    bins[j].append(c)
                    free[j] -= c[2]
                    break
            else:
                bins.append([c])
                free.append(self.spec.seq_len - c[2])
        self._rows.extend(bins)

    def plan(self, i: int) -> list[Chunk]:
        """Row i as chunks (packs up to it; no tokens produced)."""
        while len(self._rows) <= i:
            self._grow()
        return self._rows[i]

    def row(self, i: int) -> list[np.ndarray]:
        """Row i's chunks as token arrays."""
        return [self.corpus.doc(d)[at:at + n] for d, at, n in self.plan(i)]

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
        return sum(c[2] for c in self.plan(i))


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


def check_data(spec: DataSpec, layout: Layout) -> None:
    """Preflight of the run's data: the corpus opens (files present and intact, the tokenizer
    loads and fits the model's vocabulary, token ids in range) and its training split can fill
    one global batch without repeating a document. Raises SpecError naming --data/--tokenizer."""
    corpus = Corpus(spec, "train")
    if corpus.source is None:
        return  # the synthetic corpus is endless
    lengths = corpus.doc_lengths()
    s = spec.seq_len
    rem = lengths % s
    sequences = int((lengths // s).sum() + (rem >= 2).sum())  # as _chunks cuts them
    need = layout.rows_per_step
    if sequences < need:
        raise SpecError("--data", f"{spec.token_file}'s training split has {len(lengths)} documents, "
                        f"{int(lengths.sum())} tokens, {sequences} sequences of at most {s} tokens; one global "
                        f"batch needs {need} rows (micro-batch {layout.micro_batch} x grad-accum "
                        f"{layout.grad_accum} x dp {layout.dp})",
                        "give a larger corpus, or a plan with a smaller global batch")
