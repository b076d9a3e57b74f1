"""DeepSpeed's published runs as rows (planner calibrate --reference): loading and validating
profiles/reference/deepspeed-rows.json (shared reference/deepspeed-at-scale.md A-E, every
assumption the source leaves open), and each row's estimate in the source's own convention (step
time, or TFLOP/s per GPU = the source's FLOPs formula per step / predicted step time / GPUs).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from planner.cost import estimate
from planner.specs import Estimate, ModelSpec, Plan, TrainSpec, parse_cluster
from planner.specs.estimate import GB
from planner.specs.hardware import PROFILES_DIR, DeviceProfile, Host
from planner.specs.cluster import ClusterSpec

DATA = PROFILES_DIR / "reference" / "deepspeed-rows.json"
"""DeepSpeed's published runs as rows (shared reference/deepspeed-at-scale.md A-E, with every
assumption the source leaves open)."""

VARIANTS = {"offload_optimizer": "none", "offload_params": "none", "hpz": 1, "quantized_weights": False,
            "quantized_gradients": False, "mics_shard": 0}



@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    id: str
    section: str
    gen: str
    source: str
    tag: str
    note: str
    fit: bool
    """Marked for fitting in the data (False: held out)."""
    needs_variant: bool
    """The row's point is a ZeRO variant: out of the fit while the cost model cannot represent it."""
    metric: str
    """step_s (seconds per step) or tflops (TFLOP/s per GPU in the source's convention)."""
    measured: float
    flops: str | None
    """The source's FLOPs convention: megatron or 8nt (None for step-time rows)."""
    published_tflops: float | None
    memory_gb: float | None
    memory_kind: str
    """device (the GPU's peak: the estimate's total) or allocated (torch max allocated: the
    estimate's total less its runtime allowance)."""
    phases_s: Mapping[str, float] | None
    model: ModelSpec
    train: TrainSpec
    plan: Plan
    cluster_name: str
    gpus: str
    inter_gbps: float | None
    intra_gbps: float | None
    host: Mapping[str, float] | None
    assumed: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.plan.world_size


def _world(gpus: str) -> int:
    nums = [int(x) for x in gpus.lower().split("x")[:-1]]
    return math.prod(nums) if nums else 1


def load_rows(path: Path = DATA, inter_gbps: Mapping[str, float] | None = None) -> list[Row]:
    """Every row of the data file as a Row; `inter_gbps` overrides a cluster's inter-node link."""
    data = json.loads(Path(path).read_text())
    out = []
    for r in data["rows"]:
        d = data["defaults"][r["defaults"]]
        fam = data["families"][d["family"]]
        cname = r.get("cluster", d.get("cluster"))
        cl = data["clusters"][cname]
        layers, hidden, heads = r["model"]
        m = dict(fam["model"])
        mult = m.pop("ffn_mult")
        seq = d["seq"]
        model = ModelSpec(name=f"{d['family']}-{layers}x{hidden}", hidden=hidden, layers=layers, heads=heads,
                          ffn_hidden=mult * hidden, max_seq=seq, **m)
        pk = {**d.get("plan", {}), **r["plan"]}
        tp, pp = pk.pop("tp", 1), pk.pop("pp", 1)
        dp = pk.pop("dp", _world(cl["gpus"]) // (tp * pp))
        mb = pk.pop("micro_batch")
        gbs = r.get("global_batch", mb * dp)
        if gbs % (mb * dp):
            raise ValueError(f"{r['id']}: global batch {gbs} is not a multiple of micro-batch {mb} x dp {dp}")
        plan = Plan(dp=dp, tp=tp, pp=pp, zero=pk.pop("zero", d["zero"]), micro_batch=mb, grad_accum=gbs // (mb * dp),
                    recompute=d["recompute"], precision=d["precision"], **pk)
        train = TrainSpec(global_batch=gbs, seq_len=seq, precision=d["precision"], attention="eager")
        assumed = (fam["assumed"], cl["assumed"], *d.get("assumed", ()), *r.get("assumed", ()))
        out.append(Row(
            id=r["id"], section=d.get("section", r["defaults"]), gen=d["gen"], source=data["sources"][d["source"]],
            tag=r["tag"], note=r.get("note", ""), fit=bool(r["fit"]),
            needs_variant=bool(r.get("needs_variant", False)),
            metric=d["metric"], measured=float(r["measured"]), flops=d.get("flops"),
            published_tflops=r.get("published_tflops"), memory_gb=r.get("memory_gb"),
            memory_kind=d.get("memory_kind", "device"), phases_s=r.get("phases_s"), model=model, train=train,
            plan=plan, cluster_name=cname, gpus=cl["gpus"],
            inter_gbps=(inter_gbps or {}).get(cname, cl.get("inter_gbps")), intra_gbps=cl.get("intra_gbps"),
            host=cl.get("host"), assumed=assumed))
    return out


def source_flops(row: Row) -> float:
    """FLOPs per step in the source's convention (hardware FLOPs, recompute counted)."""
    m, t = row.model, row.train
    b, s, l, h, v = t.global_batch, t.seq_len, m.layers, m.hidden, m.vocab
    if row.flops == "megatron":  # Narayanan et al. 2021 eq. 3; Megatron-DeepSpeed's throughput calculator
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    if row.flops == "8nt":
        return 8.0 * m.params * b * s
    raise ValueError(f"{row.id}: no FLOPs convention")


def cluster_for(row: Row, device: DeviceProfile) -> ClusterSpec:
    c = parse_cluster(row.gpus, device, inter_gbps=row.inter_gbps, intra_gbps=row.intra_gbps)
    if row.host:
        c = dataclasses.replace(c, host=Host(**row.host))
    return c


def run_estimate(row: Row, device: DeviceProfile, plan: Plan | None = None) -> Estimate:
    return estimate(row.model, cluster_for(row, device), row.train, plan or row.plan)


def value_of(row: Row, est: Estimate) -> float:
    """The estimate in the row's metric."""
    if row.metric == "step_s":
        return est.step_time_s
    return source_flops(row) / est.step_time_s / row.world / 1e12


def predict(row: Row, device: DeviceProfile) -> float:
    return value_of(row, run_estimate(row, device))


def unrepresented(row: Row, device: DeviceProfile) -> list[str]:
    """The row's ZeRO variants the cost model ignores (its estimate is unchanged without them)."""
    est = run_estimate(row, device)
    out = []
    for k, off in VARIANTS.items():
        if getattr(row.plan, k) == off:
            continue
        try:
            other = run_estimate(row, device, dataclasses.replace(row.plan, **{k: off}))
        except Exception:  # noqa: BLE001 - a plan the variant's rules reject without it: it matters
            continue
        if other.step_time_s == est.step_time_s and other.peak_memory_bytes == est.peak_memory_bytes:
            out.append(f"{k}={getattr(row.plan, k)}")
    return out


def memory_of(row: Row, est: Estimate) -> float:
    mb = est.stage_memory[est.peak_stage]
    return (mb.total - (mb.overhead if row.memory_kind == "allocated" else 0.0)) / GB


def phases_of(est: Estimate) -> dict[str, float]:
    """forward compute / optimizer step / the rest (backward, recompute and every exposed
    collective: the estimate does not split ZeRO-3's gathers by phase)."""
    t = est.time
    return {"forward": t.forward, "optimizer": t.optimizer, "backward": est.step_time_s - t.forward - t.optimizer}


