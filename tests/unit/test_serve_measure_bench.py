"""benchmarks/serve_measure.py: a QPS-at-target row whose latency falls as the offered rate rises
is marked contended (the machine, not the model, made it)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    if "serve_measure" in sys.modules:
        return sys.modules["serve_measure"]
    spec = importlib.util.spec_from_file_location("serve_measure", ROOT / "benchmarks" / "serve_measure.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_measure"] = mod
    spec.loader.exec_module(mod)
    return mod


sm = _bench()


def test_latency_falls_marks_the_contended_probes():
    # issue 24 round 7, tiny TP2 mb8 (req/s, p50 s): 3.669 -> 2.570 is a 30% drop, 2.570 -> 2.619 a rise
    probes = [(12.4, 0.841), (15.5, 0.891), (18.5, 1.230), (21.6, 3.669), (24.7, 2.570), (28.8, 2.619)]
    assert sm.latency_falls(probes) == [(21.6, 24.7)]
    # the same round's tiny TP1 mb4: latency only rises with the rate
    quiet = [(68.5, 0.033), (85.7, 0.034), (102.8, 0.040), (119.9, 0.047), (137.1, 0.065), (159.9, 0.092)]
    assert sm.latency_falls(quiet) == []


def test_latency_falls_band_and_order():
    # a 20% dip is inside the 25% band (noise on short runs); 30% is not; order of probes does not matter
    assert sm.latency_falls([(1.0, 1.0), (2.0, 0.8)]) == []
    assert sm.latency_falls([(2.0, 0.7), (1.0, 1.0)]) == [(1.0, 2.0)]
    assert sm.latency_falls([(1.0, 1.0), (2.0, 0.8)], fall=0.1) == [(1.0, 2.0)]
