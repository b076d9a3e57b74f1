"""Tokenize text corpora once into a Megatron indexed dataset (what `planner prepare-data` runs)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from planner.data import indexed
from planner.data.text import load_tokenizer, read_documents, tokenize, train_tokenizer, vocab_size
from planner.errors import SpecError
from planner.rundir import check_writable


def prepare(inputs: list[Path], prefix: Path, *, tokenizer: str | Path = "", train_vocab: int | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Write PREFIX.bin/.idx from the inputs' documents (each followed by the eos id); with
    train_vocab, first train a tokenizer into PREFIX-tokenizer/. Returns what was written."""
    t0 = time.perf_counter()
    for p in inputs:
        if not p.is_file():
            raise SpecError("INPUT", f"{p} does not exist or is not a file", "give .txt or .jsonl files")
    check_writable(prefix.parent, "--out")
    # the inputs are read (and refused) before anything is written, the trained tokenizer too
    docs = [d for p in inputs for d in read_documents(p, "INPUT")]
    if not docs:
        raise SpecError("INPUT", "the inputs hold no document", "give non-empty text")
    trained = train_vocab is not None
    if trained:
        tokenizer = train_tokenizer(inputs, train_vocab, Path(f"{prefix}-tokenizer"))
    tok = load_tokenizer(tokenizer)
    vocab = vocab_size(tok)
    dtype = indexed.best_dtype(vocab)
    with indexed.IndexedWriter(prefix, dtype) as w, _bar(progress, len(docs)) as advance:
        for ids in tokenize(tok, docs):
            w.add(ids)
            advance()
    return {"prefix": str(prefix), "bin": str(w.bin_path), "idx": str(w.idx_path), "tokenizer": str(tokenizer),
            "trained_tokenizer": trained, "vocab": vocab, "documents": len(w.sizes), "tokens": w.tokens,
            "dtype": dtype.__name__, "seconds": time.perf_counter() - t0}


class _bar:
    """A rich progress bar over documents (nothing when off)."""

    def __init__(self, on: bool, total: int) -> None:
        self.on, self.total = on, total

    def __enter__(self):
        if not self.on:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.p = Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          transient=True, console=Console(stderr=True))  # stdout keeps only the summary
        self.p.start()
        task = self.p.add_task("docs", total=self.total)
        return lambda: self.p.advance(task)

    def __exit__(self, *exc) -> None:
        if self.on:
            self.p.stop()
