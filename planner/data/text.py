"""Raw text corpora and Hugging Face tokenizers.

A corpus file is read as documents:
- `.jsonl` (or `.json`): one JSON object per line with a string "text" field; blank lines are
  skipped, any other line that is not such an object is an error naming the line.
- anything else (`.txt`, `.md`, ...): plain UTF-8 text, one document per paragraph, paragraphs
  separated by one or more blank lines (single line breaks stay inside the document).

Tokenizers are local Hugging Face tokenizer directories (tokenizer.json and its config), loaded
with transformers' AutoTokenizer, local_files_only: nothing is downloaded. `train_tokenizer`
makes one (byte-level BPE, the `tokenizers` package) when the user has none.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from planner.errors import SpecError

EOS = "<|endoftext|>"
"""The end-of-document token of tokenizers trained here (GPT-2's name for it)."""
BYTE_ALPHABET = 256
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def is_jsonl(path: str | Path) -> bool:
    return Path(path).suffix in (".jsonl", ".json")


def read_documents(path: str | Path, field: str = "--data") -> Iterator[str]:
    """The documents of one text or JSON-lines file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(field, f"{p} does not exist or is not a file", "give a .txt or .jsonl corpus")
    try:
        if is_jsonl(p):
            with open(p, encoding="utf-8") as fh:
                for n, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise SpecError(field, f"{p} line {n} is not JSON: {exc.msg}",
                                        'one JSON object per line, e.g. {"text": "..."}') from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise SpecError(field, f'{p} line {n} has no string "text" field',
                                        'one JSON object per line, e.g. {"text": "..."}')
                    if obj["text"].strip():
                        yield obj["text"]
        else:
            text = p.read_text(encoding="utf-8")
            for doc in _PARAGRAPH.split(text):
                if doc.strip():
                    yield doc.strip()
    except UnicodeDecodeError as exc:
        raise SpecError(field, f"{p} is not UTF-8 text: {exc.reason} at byte {exc.start}",
                        "convert the corpus to UTF-8") from None


def load_tokenizer(path: str | Path, field: str = "--tokenizer"):
    """A local Hugging Face tokenizer directory, as transformers' AutoTokenizer loads it.
    Raises SpecError when it is missing, unreadable or has no end-of-document token."""
    return _load(str(Path(path).resolve()), field)


@lru_cache(maxsize=4)
def _load(path: str, field: str):
    p = Path(path)
    fix = ("give a local Hugging Face tokenizer directory, or make one with "
           "`planner prepare-data ... --train-tokenizer N`")
    if not p.is_dir():
        raise SpecError(field, f"tokenizer directory {p} does not exist", fix)
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((p / f).exists() for f in files):
        raise SpecError(field, f"{p} holds no tokenizer (none of {', '.join(files)})", fix)
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(field, f"cannot load a tokenizer from {p}: {msg}", fix) from None
    if tok.eos_token_id is None:
        raise SpecError(field, f"the tokenizer in {p} has no end-of-document (eos) token",
                        "set eos_token in its tokenizer_config.json")
    return tok


def vocab_size(tok) -> int:
    """Token ids the tokenizer can produce: its base vocabulary plus added tokens."""
    return len(tok)


def tokenize(tok, docs: list[str], batch: int = 512) -> Iterator[list[int]]:
    """Token ids of each document followed by the tokenizer's eos (Megatron's --append-eod)."""
    eos = tok.eos_token_id
    for i in range(0, len(docs), batch):
        for ids in tok(docs[i:i + batch], add_special_tokens=False)["input_ids"]:
            yield [*ids, eos]


def train_tokenizer(inputs: list[str | Path], vocab: int, out: str | Path) -> Path:
    """Train a byte-level BPE of at most `vocab` tokens (eos included) on the inputs' documents
    and save it as a Hugging Face tokenizer directory `out` (atomically: temp dir, rename)."""
    if vocab < BYTE_ALPHABET + 1:
        raise SpecError("--train-tokenizer", f"{vocab} tokens cannot hold the {BYTE_ALPHABET} byte symbols "
                        "and the eos token", f"ask for at least {BYTE_ALPHABET + 1}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d for f in inputs for d in read_documents(f, "INPUT")), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        fast.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp makes 0700; a tokenizer directory is an ordinary folder
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _load.cache_clear()
    return out
