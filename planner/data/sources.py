"""Finite corpora behind `--data`: documents as int64 token arrays, opened once per process.

A source has len(), doc(k) and lengths(), and pickles for DataLoader worker processes: documents
held in memory travel with it, an indexed dataset travels as its path (workers reopen the memmaps). planner/data/batching.py
explains the kinds of file and how they are chosen.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from planner.errors import SpecError


class _Docs:
    """Documents held in memory."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def doc(self, k: int) -> np.ndarray:
        return self.docs[k]

    def lengths(self) -> np.ndarray:
        return np.array([len(d) for d in self.docs], dtype=np.int64)


class _Indexed:
    """A Megatron indexed dataset; pickles as its path (memmaps are reopened, not copied)."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __reduce__(self):
        return _reopen, (str(self.ds.idx_path),)

    def __len__(self) -> int:
        return len(self.ds)

    def doc(self, k: int) -> np.ndarray:
        return self.ds.doc(k)

    def lengths(self) -> np.ndarray:
        return self.ds.doc_lengths()


def _reopen(idx: str) -> _Indexed:
    from planner.data.indexed import IndexedDataset
    return _Indexed(IndexedDataset(idx))


def open_source(spec):
    """The finite corpus `spec.token_file` names, checked against the model's vocabulary."""
    from planner.data import indexed
    path, vocab = spec.token_file, spec.vocab
    eos = spec.eos_id
    if spec.tokenizer:
        from planner.data.text import load_tokenizer, vocab_size
        tok = load_tokenizer(spec.tokenizer)
        n = vocab_size(tok)
        if n > vocab:
            raise SpecError("--tokenizer", f"the tokenizer in {spec.tokenizer} has {n} tokens, more than the "
                            f"model's vocabulary of {vocab}",
                            f"train one with `planner prepare-data ... --train-tokenizer N` with N <= {vocab}, "
                            f"or use a model whose vocab is at least {n}")
        eos = tok.eos_token_id
    p = Path(path)
    if indexed.is_indexed(p) and p.suffix not in (".npy", ".txt", ".jsonl", ".json"):
        ds = indexed.IndexedDataset(p)
        if len(ds) == 0:
            raise SpecError("--data", f"{ds.idx_path} holds no document", "give a non-empty corpus")
        _check_range(ds.min_token(), ds.max_token(), vocab, str(ds.bin_path), spec.tokenizer)
        return _Indexed(ds)
    if not p.exists():
        raise SpecError("--data", f"{p} does not exist",
                        "give a Megatron PREFIX (PREFIX.bin/.idx), a .npy, a .txt or a .jsonl corpus")
    if spec.tokenizer and p.suffix != ".npy":
        docs = _tokenized(str(p.resolve()), p.stat().st_mtime_ns, str(Path(spec.tokenizer).resolve()))
    elif p.suffix in (".jsonl", ".json"):
        raise SpecError("--tokenizer", f"{p} is raw text and no tokenizer was given",
                        "give --tokenizer DIR (a Hugging Face tokenizer directory)")
    else:
        docs = _read_token_file(p, eos)
    if not docs:
        raise SpecError("--data", f"{p} holds no document of 2+ tokens", "give a non-empty corpus")
    _check_range(min(int(d.min()) for d in docs), max(int(d.max()) for d in docs), vocab, str(p), spec.tokenizer)
    return _Docs(docs)


def _check_range(lo: int, hi: int, vocab: int, where: str, tokenizer: str) -> None:
    if hi >= vocab or lo < 0:
        bad = hi if hi >= vocab else lo
        raise SpecError("--data", f"token id {bad} in {where} is outside the model's vocabulary of {vocab}",
                        "tokenize with a tokenizer whose vocabulary fits the model's"
                        if not tokenizer else "re-tokenize the corpus with this tokenizer")


@lru_cache(maxsize=4)
def _tokenized(path: str, mtime_ns: int, tokenizer: str) -> list[np.ndarray]:
    """A raw-text corpus tokenized once per process (train and eval splits share it)."""
    from planner.data.text import load_tokenizer, read_documents, tokenize
    tok = load_tokenizer(tokenizer)
    docs = list(read_documents(path))
    return [a for a in (np.array(ids, dtype=np.int64) for ids in tokenize(tok, docs)) if len(a) >= 2]


def _read_token_file(p: Path, eos: int) -> list[np.ndarray]:
    try:
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise SpecError("--data", f"{p} must hold a 1-D integer array", "save token ids with np.save")
            cuts = np.flatnonzero(arr == eos)
            return [d for d in np.split(arr.astype(np.int64), cuts + 1) if len(d) >= 2]
        return [np.array([int(t) for t in line.split()], dtype=np.int64)
                for line in p.read_text().splitlines() if len(line.split()) >= 2]
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise SpecError("--data", f"cannot read {p}: {exc}",
                        "a .npy of token ids, or a .txt with one document of integer token ids per line "
                        "(raw text needs --tokenizer)") from None
