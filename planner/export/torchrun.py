"""torchrun launch of the planner's own worker (planner.runtime.train.worker): the same processes
`launch.sh` starts with the deepspeed launcher, started by torch's elastic launcher instead
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT come from torchrun's rendezvous)."""
from __future__ import annotations

from typing import Any

from planner import dsconfig
from planner.export.common import Export, RunFiles, readme, refuse_runtime


def torchrun(run: RunFiles) -> Export:
    refuse_runtime(run, "torchrun")
    c, p = run.cluster, run.plan
    cmd = ["${TORCHRUN:-torchrun}", "--nnodes", str(c.nodes), "--nproc_per_node", str(c.gpus_per_node)]
    if c.nodes > 1:
        cmd += ["--rdzv_backend", "c10d",
                '--rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR to node 0}:${MASTER_PORT:-29500}"',
                '--rdzv_id "${RDZV_ID:-planner}"']
    else:
        cmd += ["--standalone"]
    cmd += ["--module", dsconfig.ENTRY_MODULE, "--run-dir", '"$RUN_DIR"']
    env = ["export DS_ACCELERATOR=cpu", "export MALLOC_MMAP_THRESHOLD_=65536"] if c.device.kind == "cpu" else []
    script = "\n".join([
        "#!/usr/bin/env bash",
        f"# {run.model.name}: {p.describe()}",
        f"# torchrun: {c.nodes} node(s) x {c.gpus_per_node} processes = {c.world_size}; the worker reads "
        "plan.json and ds_config.json from RUN_DIR",
        "# extra arguments go to the worker, e.g. --steps 20 --warmup 3 --data corpus.txt --tokenizer TOK_DIR",
        "set -euo pipefail",
        f'RUN_DIR="${{RUN_DIR:-{run.run_dir.resolve()}}}"',
        *env,
        " ".join(cmd) + ' "$@"']) + "\n"
    files: dict[str, Any] = {"torchrun.sh": script}
    lines = ["Files:", f"- `torchrun.sh`: starts the planner's worker ({dsconfig.ENTRY_MODULE}) on every rank with "
             "torchrun; `RUN_DIR` (default: the run directory it was exported from) holds plan.json and "
             "ds_config.json."]
    if c.nodes > 1:
        lines.append("Run it on every node with the same MASTER_ADDR (node 0's address) and RDZV_ID.")
    files["README.md"] = readme("torchrun", run, lines, [])
    return Export(files=files, run="./torchrun.sh")
