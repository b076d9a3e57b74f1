"""Training data: a seeded synthetic corpus or a user's corpus (batching: planner/data/batching.py).

Sources (`DataSpec.token_file`, the `--data` path; docs/data.md):
- empty: the synthetic corpus -- log-normal document lengths, tokens from one seeded Markov
  chain over the vocabulary (Zipfian successors), so a small model can learn it;
- PREFIX (with PREFIX.idx / PREFIX.bin beside it): a Megatron indexed dataset (planner/data/indexed.py);
- a .npy 1-D integer array: documents split at the eos id;
- a .txt without a tokenizer: one document of whitespace-separated token ids per line;
- a .txt or .jsonl with a tokenizer (`DataSpec.tokenizer`): raw text (planner/data/text.py),
  tokenized when the corpus is opened (`planner prepare-data` does it once for large corpora).

Held-out split: with eval_fraction f, document k of a finite corpus is held out when
floor((k + 1) f) > floor(k f) -- evenly spaced, 1 in 20 for f = 0.05 (documents 19, 39, ...).
The synthetic corpus draws its held-out documents from their own seeds. split="train" never
yields a held-out document; split="eval" yields only those.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.data.sources import open_source
from planner.errors import SpecError

SPLITS = ("train", "eval")
CHAIN_SUCCESSORS = 8
"""Synthetic corpus: each token has this many possible successors (Zipfian odds among them)."""
CHAIN_ZIPF = 1.1
"""Synthetic corpus: Zipf exponent of how often each token is chosen as a successor."""
NOISE = 0.1
"""Synthetic corpus: share of tokens drawn uniformly instead of from the chain."""

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
    """The --data path: a Megatron PREFIX (PREFIX.bin/.idx), a .npy 1-D int array (documents
    split at the eos id), a .txt of token ids (one document per line) or, with a tokenizer, a
    .txt / .jsonl of raw text; empty = synthetic."""
    tokenizer: str = ""
    """A local Hugging Face tokenizer directory: makes .txt/.jsonl raw text, gives the eos id,
    and its vocabulary must fit the model's."""
    eval_fraction: float = 0.05
    """Held-out share of documents (deterministic, evenly spaced); 0 = no held-out split."""
    eos_id: int = 0
    """End-of-document id splitting a .npy (the tokenizer's eos when a tokenizer is given)."""
    buffer: int = 64
    """Packing window: chunks considered together by first-fit-decreasing."""

    def __post_init__(self) -> None:
        if self.sigma < 0 or self.min_len < 2 or self.buffer < 1:
            raise SpecError("data", "sigma >= 0, min_len >= 2 and buffer >= 1 are required", "fix the data options")
        if not 0 <= self.eval_fraction < 1:
            raise SpecError("data", f"eval_fraction {self.eval_fraction} is outside [0, 1)",
                            "hold out a share of documents below 1, e.g. 0.05")


def is_eval_doc(k: np.ndarray | int, fraction: float):
    """Document k is held out when floor((k + 1) f) > floor(k f), in exact integer arithmetic."""
    f = round(fraction * 1_000_000)
    k = np.asarray(k, dtype=np.int64)
    return (k + 1) * f // 1_000_000 > k * f // 1_000_000


@lru_cache(maxsize=8)
def _chain(seed: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The synthetic corpus's Markov chain, shared by every document of a seed: successors
    [vocab, CHAIN_SUCCESSORS] drawn Zipfian over a seeded ranking of ids 1..vocab-1 (0 is eos),
    the odds of picking each successor column, and the ranking (for first tokens)."""
    rng = np.random.default_rng((seed, 0, 2))
    ids = rng.permutation(np.arange(1, vocab))
    zipf = 1.0 / np.arange(1, vocab) ** CHAIN_ZIPF
    succ = ids[rng.choice(vocab - 1, size=(vocab, CHAIN_SUCCESSORS), p=zipf / zipf.sum())]
    odds = 1.0 / np.arange(1, CHAIN_SUCCESSORS + 1)
    return succ, odds / odds.sum(), ids


class Corpus:
    """An endless deterministic stream of documents (token id arrays) of one split."""

    def __init__(self, spec: DataSpec, split: str = "train") -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}")
        self.spec, self.split = spec, split
        self.source = open_source(spec) if spec.token_file else None
        self._cache: dict[int, np.ndarray] = {}
        self._lengths: np.ndarray | None = None
        self.ids: np.ndarray | None = None
        if self.source is not None:
            ks = np.arange(len(self.source), dtype=np.int64)
            held = is_eval_doc(ks, spec.eval_fraction)
            self.ids = ks[held] if split == "eval" else ks[~held]
            if not len(self.ids):
                name = "held-out" if split == "eval" else "training"
                raise SpecError("--data", f"{spec.token_file} has {len(ks)} documents, none for the {name} split "
                                f"(1 in {1 / spec.eval_fraction:.0f} is held out)" if spec.eval_fraction else
                                f"{spec.token_file} has no document for the {name} split",
                                "give a corpus with more documents")

    def _synthetic_rng(self, i: int) -> tuple[np.random.Generator, int]:
        """The document's generator after its first draw, and its length (that draw)."""
        s = self.spec
        rng = np.random.default_rng((s.seed, i) if self.split == "train" else (s.seed, i, 1))
        median = s.mean_len or s.seq_len / 3
        return rng, int(np.clip(rng.lognormal(np.log(median), s.sigma), s.min_len, 4 * s.seq_len))

    def doc_len(self, i: int) -> int:
        """Tokens in document i, without producing them (packing plans on lengths only)."""
        if self.source is not None:
            if self._lengths is None:
                self._lengths = self.source.lengths()[self.ids]
            return int(self._lengths[i % len(self.ids)])
        return self._synthetic_rng(i)[1]

    def doc(self, i: int) -> np.ndarray:
        if self.source is not None:
            return self.source.doc(int(self.ids[i % len(self.ids)]))
        got = self._cache.get(i)
        if got is None:
            if len(self._cache) >= 64:  # a long document is cut into several chunks, read one after another
                self._cache.clear()
            got = self._cache[i] = self._synthetic(i)
        return got

    def _synthetic(self, i: int) -> np.ndarray:
        s = self.spec
        rng, n = self._synthetic_rng(i)
        # a learnable signal shared by all documents: one Markov chain with Zipfian successors
        succ, odds, ranked = _chain(s.seed, s.vocab)
        pick = rng.choice(CHAIN_SUCCESSORS, size=n, p=odds)
        noise = rng.random(n) < NOISE
        rand = rng.integers(1, s.vocab, size=n)
        toks = np.empty(n, dtype=np.int64)
        toks[0] = ranked[pick[0]]
        for t in range(1, n):
            toks[t] = rand[t] if noise[t] else succ[toks[t - 1], pick[t]]
        return toks

    def doc_lengths(self) -> np.ndarray:
        """Token counts of this split's documents (a finite corpus only)."""
        assert self.source is not None and self.ids is not None
        return self.source.lengths()[self.ids]

    def __getstate__(self):
        return {"spec": self.spec, "split": self.split, "source": self.source, "ids": self.ids}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state, _cache={}, _lengths=None)


def data_spec(data: str, tokenizer: str, seed: int, trainspec, spec) -> DataSpec:
    """The DataSpec of a run's --data / --tokenizer / --seed: the worker reads this corpus and
    the launcher's preflight checks the same one (planner/runtime/preflight/checks.py)."""
    return DataSpec(seq_len=trainspec.seq_len, vocab=spec.vocab, seed=seed, token_file=data, tokenizer=tokenizer)
