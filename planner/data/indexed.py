"""Megatron-LM's memory-mapped indexed dataset: PREFIX.bin (token ids) + PREFIX.idx (the index).

The format (Megatron-LM / Megatron-DeepSpeed `megatron/data/indexed_dataset.py`,
MMapIndexedDataset; all little-endian):

    .idx  magic   9 bytes  b"MMIDIDX\\x00\\x00"
          version uint64   1
          dtype   uint8    code of the token dtype (DTYPES)
          n       uint64   number of sequences
          m       uint64   length of the document index (documents + 1)
          sizes     int32[n]  tokens per sequence
          pointers  int64[n]  byte offset of each sequence in .bin
          doc_idx   int64[m]  sequence index where each document starts; [0, ..., n]
    .bin  the sequences' token ids back to back, in the dtype above.

A document is the sequences doc_idx[k] .. doc_idx[k+1] - 1 (one sequence per document when
written by `planner prepare-data`, as Megatron's preprocess_data.py without --split-sentences).
Reading is lazy (numpy memmap): a corpus larger than host memory is fine.
"""
from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from planner.errors import SpecError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron's dtype codes (6 and 7 are float types Megatron accepts; a token file never uses them)."""
HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def code_of(dtype) -> int:
    for code, t in DTYPES.items():
        if np.dtype(t) == np.dtype(dtype):
            return code
    raise ValueError(f"no Megatron dtype code for {dtype}")


def best_dtype(vocab: int) -> type:
    """uint16 below 65500 tokens, int32 above (Megatron's best_fitting_dtype)."""
    return np.uint16 if vocab < 65500 else np.int32


def paths(prefix: str | Path) -> tuple[Path, Path]:
    p = str(prefix)
    for ext in (".bin", ".idx"):
        if p.endswith(ext):
            p = p[: -len(ext)]
    return Path(p + ".bin"), Path(p + ".idx")


def is_indexed(path: str | Path) -> bool:
    """PATH is a prefix (or PREFIX.bin / PREFIX.idx) whose .idx exists."""
    return paths(path)[1].exists()


class IndexedDataset:
    """Documents of a PREFIX.bin/.idx pair, read through numpy memmaps."""

    def __init__(self, prefix: str | Path) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.exists():
                raise SpecError("--data", f"{p} does not exist",
                                "give the PREFIX of a PREFIX.bin/PREFIX.idx pair (planner prepare-data writes one)")
        idx = self.idx_path
        size = idx.stat().st_size

        def bad(problem: str) -> SpecError:
            return SpecError("--data", f"{idx} is not a Megatron indexed dataset index: {problem}",
                             "re-create it with `planner prepare-data`")

        if size < HEADER:
            raise bad(f"{size} bytes, shorter than the {HEADER}-byte header")
        with open(idx, "rb") as fh:
            head = fh.read(HEADER)
        if head[:9] != MAGIC:
            raise bad(f"magic {head[:9]!r}, expected {MAGIC!r}")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise bad(f"version {version}, expected {VERSION}")
        code = head[17]
        if code not in DTYPES or code in (6, 7):
            raise bad(f"dtype code {code} is not an integer token type")
        n, m = struct.unpack("<QQ", head[18:34])
        want = HEADER + 4 * n + 8 * n + 8 * m
        if size != want:
            raise bad(f"{size} bytes, the header's {n} sequences and {m} document entries need {want} "
                      "(truncated or corrupt)")
        self.dtype = np.dtype(DTYPES[code])
        self.sizes = np.memmap(idx, np.int32, "r", offset=HEADER, shape=(n,)) if n else np.zeros(0, np.int32)
        self.pointers = (np.memmap(idx, np.int64, "r", offset=HEADER + 4 * n, shape=(n,)) if n
                         else np.zeros(0, np.int64))
        self.doc_idx = (np.memmap(idx, np.int64, "r", offset=HEADER + 12 * n, shape=(m,)) if m
                        else np.zeros(0, np.int64))
        if m < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n or np.any(np.diff(self.doc_idx) < 0):
            raise bad("the document index does not run from 0 to the sequence count")
        if n and (np.any(self.sizes < 0) or self.pointers[0] != 0 or np.any(
                np.diff(self.pointers) != self.sizes[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise bad("the pointers do not follow the sequence sizes")
        tokens = int(self.sizes.astype(np.int64).sum())
        bin_size = self.bin_path.stat().st_size
        if bin_size != tokens * self.dtype.itemsize:
            raise SpecError("--data", f"{self.bin_path} holds {bin_size} bytes, its index says "
                            f"{tokens} tokens of {self.dtype.itemsize} bytes = {tokens * self.dtype.itemsize} "
                            "(truncated or corrupt)", "re-create it with `planner prepare-data`")
        self.tokens = tokens
        self._bin = (np.memmap(self.bin_path, self.dtype, "r", shape=(tokens,)) if tokens
                     else np.zeros(0, self.dtype))
        # token offset where each sequence starts, and one past the end; document k spans
        # sequences doc_idx[k] .. doc_idx[k + 1] - 1, contiguous in .bin (checked above)
        bounds = np.append(self.pointers // self.dtype.itemsize, tokens)
        self._doc_start = bounds[self.doc_idx[:-1]]
        self._doc_end = bounds[self.doc_idx[1:]]

    def __len__(self) -> int:
        return len(self.doc_idx) - 1

    def doc(self, k: int) -> np.ndarray:
        return np.asarray(self._bin[self._doc_start[k]:self._doc_end[k]], dtype=np.int64)

    def doc_lengths(self) -> np.ndarray:
        return (self._doc_end - self._doc_start).astype(np.int64)

    def max_token(self) -> int:
        return int(self._bin.max()) if self.tokens else -1

    def min_token(self) -> int:
        return int(self._bin.min()) if self.tokens else 0


class IndexedWriter:
    """Writes PREFIX.bin/.idx atomically: temporary files in the same folder, renamed at close.
    One sequence per document. Use as a context manager; an exception leaves nothing behind."""

    def __init__(self, prefix: str | Path, dtype=np.uint16) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        code_of(self.dtype)
        fd, self._tmp_bin = tempfile.mkstemp(dir=self.bin_path.parent, prefix=f".{self.bin_path.name}.", suffix=".tmp")
        self._fh = os.fdopen(fd, "wb")
        self.sizes: list[int] = []
        self.tokens = 0

    def add(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < np.iinfo(self.dtype).min or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id outside {self.dtype}")
        self._fh.write(arr.astype(self.dtype).tobytes())
        self.sizes.append(int(arr.size))
        self.tokens += int(arr.size)

    def close(self) -> None:
        self._fh.close()
        n = len(self.sizes)
        sizes = np.array(self.sizes, np.int32)
        pointers = np.zeros(n, np.int64)
        if n > 1:
            pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * self.dtype.itemsize
        doc_idx = np.arange(n + 1, dtype=np.int64)
        header = (MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", code_of(self.dtype))
                  + struct.pack("<QQ", n, n + 1))
        fd, tmp_idx = tempfile.mkstemp(dir=self.idx_path.parent, prefix=f".{self.idx_path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
            for tmp in (self._tmp_bin, tmp_idx):
                os.chmod(tmp, 0o644)
            os.replace(self._tmp_bin, self.bin_path)  # .bin first: an .idx never points at a missing .bin
            os.replace(tmp_idx, self.idx_path)
        except BaseException:
            self.abort(tmp_idx)
            raise

    def abort(self, *extra: str) -> None:
        self._fh.close()
        for tmp in (self._tmp_bin, *extra):
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
