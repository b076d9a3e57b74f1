"""Raw text corpora with a tokenizer trained on the fly (no hub): reading, prepare-data, the
vocabulary check and the command's one-line errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.data.indexed import IndexedDataset
from planner.data.text import load_tokenizer, read_documents, train_tokenizer
from planner.errors import SpecError
from planner.data.corpus import Corpus, DataSpec
from planner.data.batching import Layout, Rows, check_data

pytest.importorskip("transformers")

TEXT = "\n\n".join(f"Paragraph {k} says the quick brown fox jumps over the lazy dog {k} times.\nStill {k}."
                   for k in range(30))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("text")
    (d / "c.txt").write_text(TEXT + "\n\n   \n\n")
    assert main(["prepare-data", str(d / "c.txt"), "--train-tokenizer", "300", "--out", str(d / "c"),
                 "--no-progress"]) == 0
    return d / "c", d / "c-tokenizer"


def test_text_documents_are_paragraphs_and_jsonl_lines_name_the_bad_line(tmp_path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one\ntwo\n\n\n  three \n \nfour")
    assert list(read_documents(f)) == ["one\ntwo", "three", "four"]
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "x"}\n\n{"text": "y", "id": 2}\n')
    assert list(read_documents(j)) == ["x", "y"]
    j.write_text('{"text": "x"}\n{"body": "y"}\n')
    with pytest.raises(SpecError, match=r'a.jsonl line 2 has no string "text" field'):
        list(read_documents(j))
    j.write_text('{"text": "x"}\n{"text": \n')
    with pytest.raises(SpecError, match="a.jsonl line 2 is not JSON"):
        list(read_documents(j))


def test_prepare_data_round_trips_the_text(corpus) -> None:
    prefix, tokdir = corpus
    tok = load_tokenizer(tokdir)
    assert len(tok) <= 300 and tok.eos_token == "<|endoftext|>"
    ds = IndexedDataset(prefix)
    assert len(ds) == 30 and ds.dtype == np.uint16
    for k in (0, 29):
        ids = ds.doc(k)
        assert ids[-1] == tok.eos_token_id  # eos closes every document
        want = f"Paragraph {k} says the quick brown fox jumps over the lazy dog {k} times.\nStill {k}."
        assert tok.decode(ids[:-1]) == want
    # the raw .txt with the tokenizer gives the same documents as the prepared dataset
    raw = Corpus(DataSpec(seq_len=32, vocab=300, token_file=str(prefix.with_suffix(".txt")), tokenizer=str(tokdir)))
    prep = Corpus(DataSpec(seq_len=32, vocab=300, token_file=str(prefix), tokenizer=str(tokdir)))
    assert all(np.array_equal(raw.doc(i), prep.doc(i)) for i in range(28))
    assert not [p for p in prefix.parent.iterdir() if p.name.startswith(".")]  # temp files renamed


def test_tokenizer_larger_than_the_model(corpus) -> None:
    prefix, tokdir = corpus
    n = len(load_tokenizer(tokdir))
    spec = DataSpec(seq_len=32, vocab=260, token_file=str(prefix), tokenizer=str(tokdir))
    with pytest.raises(SpecError) as e:
        check_data(spec, Layout(1, 1, 1))
    assert e.value.field == "--tokenizer"
    assert f"has {n} tokens, more than the model's vocabulary of 260" in e.value.problem
    assert "--train-tokenizer N` with N <= 260" in e.value.fix and f"vocab is at least {n}" in e.value.fix
    with pytest.raises(SpecError, match="does not exist"):
        Rows(DataSpec(seq_len=32, vocab=300, token_file=str(prefix), tokenizer=str(prefix.parent / "nope")), "static")
    (prefix.parent / "empty").mkdir(exist_ok=True)
    with pytest.raises(SpecError, match=r"holds no tokenizer \(none of tokenizer.json"):   # a directory, no tokenizer
        Rows(DataSpec(seq_len=32, vocab=300, token_file=str(prefix), tokenizer=str(prefix.parent / "empty")), "static")


def test_corpus_too_small_for_a_batch(corpus) -> None:
    prefix, tokdir = corpus
    spec = DataSpec(seq_len=8, vocab=300, token_file=str(prefix), tokenizer=str(tokdir))
    with pytest.raises(SpecError, match="training split has 29 documents.*needs 4096 rows"):
        check_data(spec, Layout(64, 8, 8))


def test_prepare_data_errors_are_one_line(tmp_path, capsys) -> None:
    f = tmp_path / "a.txt"
    f.write_text("hello world\n")
    assert main(["prepare-data", str(f), "--out", str(tmp_path / "o")]) == 2
    assert main(["prepare-data", str(f), "--out", str(tmp_path / "o"), "--train-tokenizer", "100"]) == 2
    assert main(["prepare-data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"),
                 "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "at least 257" in err[1] and "missing.txt does not exist" in err[2]
    with pytest.raises(SpecError, match="at least 257"):
        train_tokenizer([f], 256, tmp_path / "t")
    assert not list(tmp_path.glob("o.*"))


def test_an_empty_input_writes_nothing_not_even_the_tokenizer(tmp_path, capsys) -> None:
    """The inputs are read before a tokenizer is trained: an empty corpus left
    PREFIX-tokenizer/{tokenizer.json,tokenizer_config.json} behind its error (issue 25)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    out = tmp_path / "out" / "c"
    assert main(["prepare-data", str(empty), "--train-tokenizer", "300", "--out", str(out), "--no-progress"]) == 2
    assert "the inputs hold no document" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
