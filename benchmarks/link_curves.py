"""Measure each link class's latency and bandwidth from published collective timings, and say
where every number in profiles/links/classes.json comes from.

Source: microsoft/vidur (MIT) data/profiling/network/<cluster>/{all_reduce,send_recv}.csv at
7d47513363: NCCL kernel times (kineto, median of 3 x 11 launches) of fp16 all-reduce and
send/recv from 2 KB to 64 MB, on DGX A100 and DGX H100 nodes (NVSwitch inside a node) and
across two nodes (vidur/profiling/collectives/collectives_wrapper.py: `size` is bytes).

For every curve (one collective, n ranks, k of them per node) it fits, on relative error (the
profiler's alpha-beta fit, planner/profiler/fit.py, with a >= 0),

    t(S) = a + S x c / B        c = 2(n-1)/n (all-reduce), 1 (send/recv)

so a is the latency of one collective and B its bus bandwidth (nccl-tests' convention). The
intercepts of a class are then split into a fixed part per collective (launch, protocol
set-up) and a part per step: a = base + steps x step, with the ring's 2(n-1) steps of an
intra-node all-reduce and one step for a send/recv (least squares over the class's curves).

    .venv/bin/python benchmarks/link_curves.py [VIDUR_BARE_REPO]      # prints the table
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from planner.calibrate.accuracy import mape_of  # noqa: E402
from planner.profiler.fit import fit_alpha_beta  # noqa: E402

from serve_vidur_extract import _csv  # noqa: E402

VIDUR_COMMIT = "7d47513363"
CLUSTERS = {"a100_dgx": "A100-80GB", "h100_dgx": "H100-SXM"}
"""vidur's DGX clusters and the profiles whose intra-node link (NVSwitch) they measure."""


def curves(repo: str, cluster: str, kind: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """{(ranks, ranks per node): [(bytes, seconds)]} of one CSV."""
    rows = _csv(repo, f"data/profiling/network/{cluster}/{kind}.csv")
    out: dict[tuple[int, int], list[tuple[int, float]]] = collections.defaultdict(list)
    for r in rows:
        out[(int(r["num_workers"]), int(r["devices_per_node"]))].append(
            (int(r["size"]), float(r[f"time_stats.{kind}.median"]) * 1e-3))
    return {k: sorted(v) for k, v in out.items()}


def alpha_beta(points: list[tuple[int, float]], kind: str, n: int) -> tuple[float, float, float]:
    """(a seconds, B bytes/s, MAPE) of t = a + S c / B, c = bus_factor(kind, n): the profiler's
    alpha-beta fit (planner/profiler/fit.py fit_alpha_beta: least squares on relative error,
    a >= 0), whose busbw is B."""
    fit = fit_alpha_beta(kind, n, [float(p[0]) for p in points], [p[1] for p in points])
    return fit.alpha_s, fit.busbw_gbps * 1e9, mape_of([fit.predict(p[0]) for p in points], [p[1] for p in points])


def measure(repo: str) -> dict:
    fits = []
    for cluster, profile in CLUSTERS.items():
        for kind in ("all_reduce", "send_recv"):
            for (n, k), pts in curves(repo, cluster, kind).items():
                a, bw, mape = alpha_beta(pts, kind, n)
                steps = (2 * (n - 1) if kind == "all_reduce" else 1)
                fits.append({"cluster": cluster, "profile": profile, "kind": kind, "n": n, "per_node": k,
                             "class": "nvswitch" if n == k else "inter-node", "a_us": a * 1e6,
                             "busbw_gbps": bw / 1e9, "mape": mape, "steps": steps, "points": len(pts)})
    out = {"fits": fits}
    nv = [f for f in fits if f["class"] == "nvswitch"]
    x = np.array([[1.0, f["steps"]] for f in nv])
    y = np.array([f["a_us"] for f in nv])
    (base, step), *_ = np.linalg.lstsq(x, y, rcond=None)
    out["nvswitch"] = {"base_us": float(base), "step_us": float(step),
                       "busbw_gbps": {p: max(f["busbw_gbps"] for f in nv if f["profile"] == p and f["kind"] == "all_reduce")
                                      for p in CLUSTERS.values()}}
    def send(cluster: str, cls: str) -> dict:
        return next(f for f in fits if f["cluster"] == cluster and f["kind"] == "send_recv" and f["class"] == cls)
    ib, nvs = send("h100_dgx", "inter-node"), send("h100_dgx", "nvswitch")
    # a send across nodes pays what one inside the node pays plus the network hop
    out["infiniband"] = {"send_recv_us": ib["a_us"], "busbw_gbps_per_gpu": ib["busbw_gbps"],
                         "step_us": ib["a_us"] - nvs["a_us"],
                         "a100_fabric_step_us": send("a100_dgx", "inter-node")["a_us"] - send("a100_dgx", "nvswitch")["a_us"]}
    return out


def render(m: dict) -> str:
    lines = [f"{'cluster':<9} {'kind':<10} {'n':>3} {'k':>2} {'class':<10} {'a (us)':>8} {'B (GB/s)':>9} "
             f"{'MAPE':>6}"]
    for f in m["fits"]:
        lines.append(f"{f['cluster']:<9} {f['kind']:<10} {f['n']:>3} {f['per_node']:>2} {f['class']:<10} "
                     f"{f['a_us']:8.1f} {f['busbw_gbps']:9.1f} {f['mape']:6.1%}")
    nv = m["nvswitch"]
    lines.append(f"NVSwitch: a = {nv['base_us']:.1f} us + {nv['step_us']:.2f} us x ring steps; all-reduce "
                 f"busbw (a-b fit, <= 64 MB): " + ", ".join(f"{p} {v:.0f} GB/s" for p, v in nv["busbw_gbps"].items()))
    if m["infiniband"]:
        ib = m["infiniband"]
        lines.append(f"InfiniBand (DGX H100, 2 nodes, 1 GPU each): send/recv a = {ib['send_recv_us']:.1f} us, "
                     f"{ib['busbw_gbps_per_gpu']:.1f} GB/s per GPU; network step = a - the intra-node send's a = "
                     f"{ib['step_us']:.1f} us (vidur's A100 cluster, fabric unstated: {ib['a100_fabric_step_us']:.1f} us)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", nargs="?", default="/work/.mirror/microsoft+vidur/repo",
                    help="a bare clone of microsoft/vidur (the fetch tool's mirror)")
    a = ap.parse_args(argv)
    m = measure(a.repo)
    print(render(m))
    return m


if __name__ == "__main__":
    main()
