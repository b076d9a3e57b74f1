"""Executor parts without DeepSpeed processes: data, batching, monitor, model variants, metrics."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from planner.errors import SpecError
from planner.executor.data import DataSpec, Layout, Rows, batches_for_tokens, padding_stats
from planner.executor.metrics import relative_error
from planner.executor.monitor import MonitorSettings, StabilityMonitor
from planner.specs import preset, scale

torch = pytest.importorskip("torch")
from planner.executor.model import GLMModel, block_flags, lm_loss  # noqa: E402

SPEC = DataSpec(seq_len=64, vocab=512, seed=7)


def test_corpus_is_deterministic_and_spread() -> None:
    a, b = Rows(SPEC, "static"), Rows(SPEC, "static")
    assert all(np.array_equal(a.tensors(i)[0], b.tensors(i)[0]) for i in range(20))
    lengths = [a.real_tokens(i) for i in range(200)]
    assert min(lengths) < 20 and max(lengths) == 64  # a spread of lengths, long documents chunked
    other = Rows(dataclasses.replace(SPEC, seed=8), "static")
    assert not np.array_equal(a.tensors(0)[0], other.tensors(0)[0])


def test_packing_wastes_less_padding_on_the_same_tokens() -> None:
    lay = Layout(micro_batch=2, grad_accum=2, dp=2)
    sreal, spad = padding_stats(Rows(SPEC, "static"), lay, 10)
    dyn = Rows(SPEC, "dynamic")
    n = batches_for_tokens(dyn, lay, sreal)
    dreal, dpad = padding_stats(dyn, lay, n)
    assert dreal >= sreal and n < 10
    assert dpad / (dreal + dpad) < 0.5 * spad / (sreal + spad)


def test_packed_row_labels_and_segments() -> None:
    rows = Rows(SPEC, "dynamic")
    r = next(i for i in range(100) if len(rows.row(i)) >= 2)
    ids, pos, seg, lab = rows.tensors(r)
    chunks = rows.row(r)
    n0 = len(chunks[0])
    assert (seg[:n0] == 1).all() and pos[n0] == 0 and seg[n0] == 2
    assert lab[n0 - 1] == -100  # no prediction across documents
    assert (lab[:n0 - 1] == ids[1:n0]).all()
    assert (lab != -100).sum() == rows.real_tokens(r) - len(chunks)


def test_layout_partitions_rows() -> None:
    lay = Layout(micro_batch=2, grad_accum=3, dp=2)
    seen = [i for m in range(3) for d in range(2) for i in lay.rows(1, m, d)]
    assert sorted(seen) == list(range(12, 24))


def test_token_file(tmp_path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("1 2 3 4\n5 6\n")
    rows = Rows(DataSpec(seq_len=8, vocab=10, token_file=str(f)), "static")
    assert list(rows.tensors(0)[0][:4]) == [1, 2, 3, 4]
    f.write_text("1 2 99\n")
    with pytest.raises(SpecError, match="vocabulary"):
        Rows(DataSpec(seq_len=8, vocab=10, token_file=str(f)), "static")


def test_monitor_flags_nan_spike_and_stall() -> None:
    assert StabilityMonitor.bad(float("nan"), 1.0) and StabilityMonitor.bad(1.0, float("inf"))
    assert StabilityMonitor.bad(1.0, 2.0) is None
    mon = StabilityMonitor(MonitorSettings(spike_factor=5.0, window=4, stall_tolerance=0.01))
    events = []
    for s in range(8):
        events += mon.observe(s, 5.0 - 0.5 * s, 1.0)
    assert not events
    assert [e["kind"] for e in mon.observe(8, 1.0, 50.0)] == ["spike"]
    kinds = [e["kind"] for s in range(9, 20) for e in mon.observe(s, 1.0, 1.0)]
    assert kinds == ["stall"]  # said once when the loss flattens


@pytest.mark.parametrize("name", ["glm-10b", "glm-130b", "chatglm-6b", "chatglm3-6b", "glm-4-9b"])
def test_every_preset_family_trains_a_step(name: str) -> None:
    spec = scale(preset(name), "tiny")
    torch.manual_seed(0)
    model = GLMModel(spec, [True, False, False, False], selective=True)
    rows = Rows(DataSpec(seq_len=32, vocab=spec.vocab), "dynamic")
    ids, pos, seg, lab = (torch.from_numpy(np.stack(c)) for c in zip(rows.tensors(0), rows.tensors(1)))
    logits = model(ids, pos, seg)
    assert logits.shape == (2, 32, spec.vocab)
    loss = lm_loss(logits, lab)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(spec.vocab)) < 1.5
    loss.backward()
    n = sum(p.numel() for p in model.parameters())
    assert n == spec.params  # same parameter count as the cost model's shapes
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoint_does_not_change_gradients() -> None:
    spec = scale(preset("chatglm3-6b"), "tiny")
    rows = Rows(DataSpec(seq_len=32, vocab=spec.vocab), "static")
    batch = [torch.from_numpy(np.stack(c)) for c in zip(rows.tensors(0), rows.tensors(1))]
    grads = []
    for flags, sel in (([False] * 4, False), ([True, True, False, False], False), ([False] * 4, True)):
        torch.manual_seed(0)
        m = GLMModel(spec, flags, sel)
        lm_loss(m(*batch[:3]), batch[3]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_block_flags_first_k_of_each_stage() -> None:
    spec = scale(preset("chatglm3-6b"), "tiny")
    assert block_flags(spec, (3, 1), (2, 0)) == [True, True, False, False]


def test_relative_error_sign() -> None:
    assert relative_error(2.0, 3.0) == pytest.approx(0.5)
    assert relative_error(None, 1.0) is None
