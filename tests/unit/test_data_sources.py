"""Data sources without a tokenizer: Megatron's indexed format, .npy/.txt token files, the held-out
split, the synthetic corpus's statistics, check_data, and the loader settings."""
from __future__ import annotations

import pickle
import struct
from collections import Counter, defaultdict

import numpy as np
import pytest

from planner.data.indexed import IndexedDataset, IndexedWriter
from planner.errors import SpecError
from planner.data.corpus import Corpus, DataSpec, is_eval_doc
from planner.data.batching import Layout, Rows, check_data

torch = pytest.importorskip("torch")
from planner.data.loader import LoaderSettings, choose_loader, loader_record
from planner.runtime.train.build import loader  # noqa: E402


def _idx_bytes(code: int, sizes: list[int], pointers: list[int], doc_idx: list[int]) -> bytes:
    """An index written by hand from the format's description (not by IndexedWriter)."""
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([code]) + struct.pack("<QQ", len(sizes), len(doc_idx))
            + np.array(sizes, "<i4").tobytes() + np.array(pointers, "<i8").tobytes()
            + np.array(doc_idx, "<i8").tobytes())


def test_writer_emits_megatron_bytes(tmp_path) -> None:
    with IndexedWriter(tmp_path / "c", np.uint16) as w:
        w.add([1, 2, 3])
        w.add([4, 5])
    assert (tmp_path / "c.bin").read_bytes() == bytes([1, 0, 2, 0, 3, 0, 4, 0, 5, 0])
    # uint16 is code 8; pointers are byte offsets: 0 and 3 tokens x 2 bytes; doc_idx [0, 1, 2]
    assert (tmp_path / "c.idx").read_bytes() == _idx_bytes(8, [3, 2], [0, 6], [0, 1, 2])
    assert len((tmp_path / "c.idx").read_bytes()) == 34 + 2 * 4 + 2 * 8 + 3 * 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_reader_joins_sequences_of_a_document(tmp_path) -> None:
    # int32 (code 4): three sequences, the first document made of the first two
    (tmp_path / "m.bin").write_bytes(np.array([7, 8, 9, 10, 11, 12], "<i4").tobytes())
    (tmp_path / "m.idx").write_bytes(_idx_bytes(4, [2, 1, 3], [0, 8, 12], [0, 2, 3]))
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 2 and ds.tokens == 6
    assert ds.doc(0).tolist() == [7, 8, 9] and ds.doc(1).tolist() == [10, 11, 12]
    assert ds.doc_lengths().tolist() == [3, 3]
    assert IndexedDataset(tmp_path / "m.idx").doc(1).tolist() == [10, 11, 12]  # PREFIX.idx works as PREFIX
    got = pickle.loads(pickle.dumps(Corpus(DataSpec(seq_len=8, vocab=16, token_file=str(tmp_path / "m")))))
    assert got.doc(1).tolist() == [10, 11, 12]


@pytest.mark.parametrize("damage, where, words", [
    ("idx_tail", "m.idx", "truncated or corrupt"),
    ("bin_tail", "m.bin", "holds 20 bytes"),
    ("magic", "m.idx", "magic"),
    ("version", "m.idx", "version 2"),
    ("pointers", "m.idx", "pointers"),
])
def test_corrupt_indexed_dataset_names_the_file(tmp_path, damage: str, where: str, words: str) -> None:
    tok = np.array([7, 8, 9, 10, 11, 12], "<i4").tobytes()
    idx = _idx_bytes(4, [3, 3], [0, 12], [0, 1, 2])
    if damage == "idx_tail":
        idx = idx[:-8]
    elif damage == "bin_tail":
        tok = tok[:-4]
    elif damage == "magic":
        idx = b"XXXXXXX\x00\x00" + idx[9:]
    elif damage == "version":
        idx = idx[:9] + struct.pack("<Q", 2) + idx[17:]
    elif damage == "pointers":
        idx = _idx_bytes(4, [3, 3], [0, 8], [0, 1, 2])
    (tmp_path / "m.bin").write_bytes(tok)
    (tmp_path / "m.idx").write_bytes(idx)
    with pytest.raises(SpecError) as e:
        Rows(DataSpec(seq_len=8, vocab=16, token_file=str(tmp_path / "m")), "static")
    assert e.value.field == "--data" and str(tmp_path / where) in e.value.problem and words in e.value.problem


def test_indexed_token_outside_vocab(tmp_path) -> None:
    with IndexedWriter(tmp_path / "c", np.uint16) as w:
        w.add([1, 2, 300])
    with pytest.raises(SpecError, match="token id 300 .* vocabulary of 256"):
        Rows(DataSpec(seq_len=8, vocab=256, token_file=str(tmp_path / "c")), "static")


def test_npy_splits_at_eos(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.array([5, 6, 0, 7, 8, 9, 0, 3], np.int32))
    c = Corpus(DataSpec(seq_len=8, vocab=10, token_file=str(tmp_path / "t.npy")))
    assert [c.doc(i).tolist() for i in range(3)] == [[5, 6, 0], [7, 8, 9, 0], [5, 6, 0]]  # [3] is too short


def test_held_out_documents_are_evenly_spaced_and_never_trained_on(tmp_path) -> None:
    assert np.flatnonzero(is_eval_doc(np.arange(60), 0.05)).tolist() == [19, 39, 59]
    assert np.flatnonzero(is_eval_doc(np.arange(10), 0.3)).tolist() == [3, 6, 9]
    f = tmp_path / "t.txt"
    f.write_text("".join(f"{k} {k} {k}\n" for k in range(1, 41)))  # document k-1 is "k k k"
    spec = DataSpec(seq_len=4, vocab=64, token_file=str(f))
    train, held = Corpus(spec, "train"), Corpus(spec, "eval")
    assert [held.doc(i)[0] for i in range(3)] == [20, 40, 20]
    trained = {int(train.doc(i)[0]) for i in range(200)}
    assert trained == set(range(1, 41)) - {20, 40}
    ev = Rows(spec, "static", split="eval")
    assert ev.tensors(0)[0].tolist() == [20, 20, 20, 0]
    with pytest.raises(SpecError, match="none for the held-out split"):
        Rows(DataSpec(seq_len=4, vocab=64, token_file=str(f), eval_fraction=0.01), "static", split="eval")


def test_synthetic_held_out_documents_differ_from_training() -> None:
    spec = DataSpec(seq_len=64, vocab=512, seed=7)
    a, b = Corpus(spec), Corpus(spec, "eval")
    train = {tuple(a.doc(i)) for i in range(100)}
    assert not train & {tuple(b.doc(i)) for i in range(100)}


def test_synthetic_lengths_are_unchanged_and_tokens_follow_one_chain() -> None:
    # the lengths the affine-walk generator drew before this change (same rng draws first)
    c = Corpus(DataSpec(seq_len=64, vocab=512, seed=7))
    assert [len(c.doc(i)) for i in range(8)] == [21, 28, 24, 8, 55, 25, 79, 12]
    c = Corpus(DataSpec(seq_len=256, vocab=1024, seed=1234))
    assert [len(c.doc(i)) for i in range(8)] == [23, 65, 35, 72, 72, 119, 293, 82]
    # shared statistics: across documents, each token's 8 commonest successors cover ~90% of its
    # transitions (a per-document walk would spread them over hundreds of successors)
    nxt: dict[int, Counter] = defaultdict(Counter)
    for i in range(400):
        d = c.doc(i)
        for x, y in zip(d[:-1], d[1:]):
            nxt[int(x)][int(y)] += 1
    common = [k for k, v in nxt.items() if sum(v.values()) >= 50]
    covered = sum(sum(n for _, n in nxt[k].most_common(8)) for k in common)
    assert len(common) >= 20 and covered / sum(sum(nxt[k].values()) for k in common) > 0.85


def test_check_data_counts_sequences(tmp_path) -> None:
    f = tmp_path / "t.txt"
    f.write_text(" ".join(["1"] * 10) + "\n" + " ".join(["2"] * 5) + "\n7\n")  # "7" alone is no document
    spec = DataSpec(seq_len=4, vocab=8, token_file=str(f))
    check_data(spec, Layout(micro_batch=1, grad_accum=2, dp=2))  # 10 -> 4+4+2, 5 -> 4 (+1 dropped): 4 rows
    with pytest.raises(SpecError) as e:
        check_data(spec, Layout(micro_batch=1, grad_accum=1, dp=5))
    assert e.value.field == "--data"
    assert "2 documents, 15 tokens, 4 sequences of at most 4 tokens; one global batch needs 5 rows" in e.value.problem
    check_data(DataSpec(seq_len=4, vocab=8), Layout(64, 64, 64))  # synthetic: endless


def test_missing_files_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        Rows(DataSpec(seq_len=8, vocab=16, token_file=str(tmp_path / "nope.npy")), "static")
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(SpecError) as e:
        Rows(DataSpec(seq_len=8, vocab=16, token_file=str(tmp_path / "c.jsonl")), "static")
    assert e.value.field == "--tokenizer"


def test_loader_rule() -> None:
    rows = Rows(DataSpec(seq_len=16, vocab=64), "dynamic")
    lay = Layout(micro_batch=2, grad_accum=2, dp=1)
    # step 1 s over 2 micro-batches: 0.5 s of compute each
    s = choose_loader(rows, lay, device="cuda", step_time_s=1.0, ranks_per_host=8, cores=64, produce_s=0.04)
    assert (s.workers, s.pin_memory, s.prefetch_factor, s.starves) == (0, True, 0, False)  # 8% <= 10%
    s = choose_loader(rows, lay, device="cuda", step_time_s=1.0, ranks_per_host=8, cores=64, produce_s=0.6)
    assert (s.workers, s.prefetch_factor, s.starves) == (3, 2, False)  # ceil(1.2) + 1; 7 spare cores
    s = choose_loader(rows, lay, device="cuda", step_time_s=1.0, ranks_per_host=8, cores=24, produce_s=2.0)
    assert (s.workers, s.starves) == (2, True)  # wants 5, 24 // 8 - 1 = 2 spare: 1.0 s per batch > 0.5 s
    s = choose_loader(rows, lay, device="cpu", step_time_s=1.0, produce_s=2.0)
    assert (s.workers, s.pin_memory, s.starves) == (0, False, True)
    rec = loader_record(s)
    assert rec["workers"] == 0 and rec["starves"] is True and rec["compute_s"] == 0.5 and "no core" in rec["reason"]
    measured = choose_loader(rows, lay, device="cpu", step_time_s=1.0)
    assert 0 < measured.produce_s < 0.5


def test_loader_items_in_order_with_and_without_workers() -> None:
    lay = Layout(micro_batch=2, grad_accum=2, dp=2)
    spec = DataSpec(seq_len=16, vocab=64)
    got = {}
    for w in (0, 1):
        items = list(loader(Rows(spec, "dynamic"), lay, [0, 2], 1, "cpu", LoaderSettings(w, False, 2 if w else 0)))
        got[w] = items
    ref = Rows(spec, "dynamic")
    want = [np.stack([ref.tensors(i)[0] for i in lay.rows(b, m, 1)]) for b in (0, 2) for m in range(2)]
    for w in (0, 1):
        assert len(got[w]) == 4
        assert all(np.array_equal(item[0].numpy(), x) for item, x in zip(got[w], want))
