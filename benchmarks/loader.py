"""Does the data loader keep up? Per-micro-batch production time vs the measured step time.

For the tiny and small GLM-10B shapes on 2xcpu: plan with `planner search`, run a few steps with
`planner run` (the measured step time), then time the production of one micro-batch of the plan's
layout (pack rows, produce tokens, stack; planner/data/loader.py measure_production) from
each source kind:
- synthetic: the built-in corpus;
- indexed: text tokenized once with `planner prepare-data --train-tokenizer <model vocab>`
  into a Megatron PREFIX.bin/.idx (text: this Python's standard-library sources);
- npy: the same tokens as one .npy array, documents split at the eos id.
Prints the production time, the compute time per micro-batch, the share, the settings
choose_loader picks for this host (CPU device: no spare core) and "starves: no/yes".

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/loader.py
    .venv/bin/python benchmarks/loader.py --step-time tiny=0.125 --step-time small=0.9   # no runs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PLANNER = [sys.executable, "-c", "from planner.cli import entry; entry()"]
SHAPES = ("tiny", "small")
TEXT_BYTES = 3_000_000


def planner(*args: str) -> str:
    r = subprocess.run(PLANNER + list(args), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"planner {' '.join(args)} failed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    return r.stdout


def text_corpus(path: Path) -> Path:
    """About TEXT_BYTES of real text: the standard library's Python sources, in a fixed order."""
    parts, got = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="replace")
        parts.append(t)
        got += len(t)
        if got >= TEXT_BYTES:
            break
    path.write_text("\n\n".join(parts))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-time", action="append", default=[], metavar="SHAPE=SECONDS",
                    help="Use this step time instead of running the plan (e.g. tiny=0.125).")
    ap.add_argument("--steps", type=int, default=8, help="Steps of each measuring run (2 are warm-up).")
    ap.add_argument("--micro-batches", type=int, default=20, help="Micro-batches timed per case.")
    args = ap.parse_args()
    given = {k: float(v) for k, v in (s.split("=") for s in args.step_time)}

    from planner.data.corpus import DataSpec
    from planner.data.batching import Layout, Rows
    from planner.data.loader import choose_loader, measure_production
    from planner.rundir import load_run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = text_corpus(tmp / "stdlib.txt")
        print(f"text corpus: {text.stat().st_size / 1e6:.1f} MB of standard-library sources; "
              f"{os.cpu_count()} cores")
        print(f"{'shape':6} {'source':9} {'batching':8} {'produce ms':>10} {'compute ms':>10} {'share':>7}  "
              f"{'loader':28} starves")
        for shape in SHAPES:
            planner("search", "--model", "glm-10b", "--scale", shape, "--gpus", "2xcpu", "--out-dir", str(tmp),
                    "--name", shape)
            run_dir = tmp / shape
            plan, model, cluster, train, _ = load_run(run_dir)
            if shape in given:
                step, how = given[shape], "given"
            else:
                planner("run", str(run_dir), "--steps", str(args.steps), "--warmup", "2")
                step = json.loads((run_dir / "metrics.json").read_text())["step_time_s"]
                how = f"measured, {args.steps} steps"
            layout = Layout(plan.micro_batch, plan.grad_accum, plan.dp)
            print(f"# {shape}: {model.name}, vocab {model.vocab}, seq {train.seq_len}, micro-batch {plan.micro_batch} "
                  f"x grad-accum {plan.grad_accum} x dp {plan.dp}; step {step:.3f} s ({how})")
            prefix = tmp / f"{shape}-text"
            planner("prepare-data", str(text), "--train-tokenizer", str(model.vocab), "--out", str(prefix),
                    "--no-progress")
            tok = Path(f"{prefix}-tokenizer")
            from planner.data.indexed import IndexedDataset
            ds = IndexedDataset(prefix)
            eos = int(ds.doc(0)[-1])
            np.save(tmp / f"{shape}.npy", np.concatenate([ds.doc(k) for k in range(len(ds))]).astype(np.int32))
            sources = {"synthetic": {}, "indexed": {"token_file": str(prefix), "tokenizer": str(tok)},
                       "npy": {"token_file": str(tmp / f"{shape}.npy"), "eos_id": eos}}
            for name, kw in sources.items():
                for batching in ("dynamic", "static"):
                    spec = DataSpec(seq_len=train.seq_len, vocab=model.vocab, **kw)
                    produce = measure_production(Rows(spec, batching), layout, micro_batches=args.micro_batches)
                    s = choose_loader(Rows(spec, batching), layout, device="cpu", step_time_s=step,
                                      ranks_per_host=plan.world_size, produce_s=produce)
                    compute = step / plan.grad_accum
                    lo = f"workers {s.workers}, pin {s.pin_memory}, prefetch {s.prefetch_factor}"
                    print(f"{shape:6} {name:9} {batching:8} {produce * 1e3:10.3f} {compute * 1e3:10.1f} "
                          f"{produce / compute:7.2%}  {lo:28} {'yes' if s.starves else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
