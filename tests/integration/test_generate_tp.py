"""Generation with TP 2 on two gloo processes: rank 0 schedules and broadcasts each step, both
ranks run their TP slice (KV groups split, vocab-parallel logits gathered). The tokens must be
the single-process plain model's greedy tokens (full recompute, no cache, no TP), request by
request, under continuous batching with Poisson arrivals.

Run alone (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_generate_tp.py`
"""
from __future__ import annotations

import json

import pytest

from planner.specs import preset, scale

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch")

from planner.runtime.serve.generate import build_model, greedy_no_cache  # noqa: E402
from planner.runtime.serve.loadgen import make_requests  # noqa: E402
from planner.runtime.serve.run import METRICS_FILE, _spawn, run_serving  # noqa: E402

SPEC = scale(preset("chatglm3-6b"), "tiny")
WORKLOAD = {"prompt_len": 12, "output_len": 6, "prompt_sigma": 0.5, "output_sigma": 0.5, "seed": 4}


def _linear():
    from planner.cli.common import apply_variants
    return apply_variants(SPEC, ["linear-attention"])


@pytest.mark.parametrize("variant", ["base", "linear-attention"])
def test_tp2_continuous_batching_matches_the_plain_single_process_model(variant) -> None:
    """Also for --variant linear-attention: each TP rank keeps the d x d states of its KV group."""
    spec = SPEC if variant == "base" else _linear()
    cfg = {"model": spec.to_dict(), "tp": 2, "max_batch": 3, "workload": WORKLOAD, "rate_qps": 40.0,
           "requests": 6, "seed": 5, "timeout_s": 60, "precision": "fp32", "weights_seed": 1234,
           "max_len": 80, "record_tokens": True}
    got = _spawn(cfg)
    reqs = make_requests(WORKLOAD, 40.0, 6, 5, spec.vocab, spec.max_seq)
    model = build_model(spec, seed=1234)
    want = {str(r.rid): greedy_no_cache(model, spec, r.prompt, r.output_len) for r in reqs}
    assert got["outputs"] == want
    assert len({len(r.prompt) for r in reqs}) > 1  # sequences of different lengths shared decode steps
    assert max(s["batch"] for s in got["decode_steps"]) > 1


def test_tp2_run_serving_writes_serve_metrics(tmp_path) -> None:
    m = run_serving(SPEC, tp=2, max_batch=2, workload=WORKLOAD, rate_qps=20.0, requests=4, seed=1, timeout_s=60,
                    out_dir=tmp_path)
    on_disk = json.loads((tmp_path / METRICS_FILE).read_text())
    assert on_disk["deployment"]["tp"] == 2 and on_disk["requests"] == 4 and not on_disk["timed_out"]
    assert on_disk["ttft_s"]["p99"] >= on_disk["ttft_s"]["p50"] > 0 and m["tpot_s"]["mean"] > 0
