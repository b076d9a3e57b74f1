"""ZeRO-2's gradient partition with 4 data-parallel ranks: counted model states per rank against
planner/cost/states.py's prediction (issue 22).

DeepSpeed 0.19.8's stage 2 copies each reduced gradient of its partition into
`grads_in_partition`, which copy_grads_in_partition allocates as the sum of numel() over
params_in_partition: the whole tensors that overlap the rank's slice, i.e. ZeRO-1's owned count
(planner.cost.params.zero1_owned), not psi / dp. This starts three 4-process ZeRO-2 plans for 2
steps (the executor counts states in step 2, after backward) and prints, per rank and class,
predicted - measured bytes (metrics.json model_state_error_gb_per_rank):

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/zero2_states.py
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from planner.specs import Plan, TrainSpec, parse_cluster

HERE = Path(__file__).resolve().parent
LAYOUTS = (
    ("DP4 ZeRO-2", "chatglm3-6b", dict(dp=4, zero=2)),
    ("EP2xDP2 ZeRO-2", "glm-4.5-air", dict(dp=4, ep=2, zero=2)),
    ("SP2xDP2 ZeRO-2", "chatglm3-6b", dict(dp=2, cp=2, zero=2)),
)
GB = 1024 ** 3


def _plans_start():
    spec = importlib.util.spec_from_file_location("plans_start", HERE / "plans_start.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["plans_start"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ps = _plans_start()
    from planner.cli.common import load_model
    from planner.search.baseline import conventional_baseline
    from planner.search.driver import SearchResult
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="zero2-states-") as root:
        for name, model_arg, layout in LAYOUTS:
            model = load_model(model_arg, "tiny")
            plan = Plan(**layout, micro_batch=1, grad_accum=1, precision="fp32", bucket_elements=2_000_000)
            cluster = parse_cluster(f"{plan.world_size}xcpu")
            train = TrainSpec(global_batch=plan.global_batch, seq_len=128, precision="fp32", attention="flash")
            base_plan, base = conventional_baseline(model, cluster, train)
            result = SearchResult(method="zero2_states", trials=(), ranked=(), baseline_plan=base_plan, baseline=base,
                                  space_size=0, wall_s=0.0)
            s = ps.Searched(model_arg=model_arg, gpus=cluster.spec, model=model, cluster=cluster, train=train,
                            result=result, command=f"benchmarks/zero2_states.py {name}")
            case = ps.Case(searched=s, plan=plan, kind=name)
            ps.write_run(case, Path(root) / name.replace(" ", "_"))
            from planner.runtime.train.launch import run_plan
            m = run_plan(Path(root) / name.replace(" ", "_"), steps=2, warmup=0, timeout=600)
            if m.get("status") != "ok":
                print(f"{name}: FAILED {m.get('status')}: {m.get('error')}")
                return 1
            errs = m["model_state_error_gb_per_rank"]
            measured = m["model_state_breakdown_gb_per_rank"]
            for r, (e, got) in enumerate(zip(errs, measured)):
                line = ", ".join(f"{k} {got[k] * GB:,.0f} B (pred - meas {e[k] * GB:+,.0f})"
                                 for k in ("params", "grads", "optimizer") if k in got)
                print(f"{name} ({model.name}) rank {r}: {line}")
                worst = max(worst, abs(e.get("grads", 0.0)) * GB)
    print(f"largest |predicted - measured| gradient bytes over the ranks: {worst:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
