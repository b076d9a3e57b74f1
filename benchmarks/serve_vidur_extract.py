"""Extract the measured kernel curves that the serving cost model uses from microsoft/vidur's
profiling data (profiles/serving/vidur.json): per-layer compute timings and the all-reduce.

vidur (Agrawal et al. 2024, "Vidur: A Large-Scale Simulation Framework for LLM Inference",
MLSys 2024) ships per-operation GPU timings measured with CUDA events on A100 and H100:
data/profiling/compute/<gpu>/meta-llama/Llama-2-7b-hf/mlp.csv (each linear layer and each
elementwise op of one transformer block, by tokens in the batch and TP degree, in ms), and
data/profiling/network/<gpu>_dgx/all_reduce.csv (torch.distributed.all_reduce, NCCL, of fp16
tensors inside one CUDA graph on one DGX node, by element count and workers, in ms). vLLM runs
its own custom all-reduce kernel for small tensors on full NVLink and NCCL above it; NCCL's
timing is the measured figure here for both (the custom kernel is not measured in vidur's
data). For the all-reduce, the element counts of a step's activations (tokens x 4096 for the
token counts below) are taken as the median of the 5 measured sizes nearest in log scale (the
single-size medians scatter by 2-5x at 2k-20k elements), then the running maximum over the
sizes (a larger all-reduce is never taken faster than a smaller one). vidur's attention.csv (the attention
kernels by batch and context) is not in the mirror (its blobs are absent), and vidur ships no
cpu_overhead data (its config's cpu_overhead_input_file has no file in the repository;
skip_cpu_overhead_modeling defaults to True). This script reads the CSVs from a bare clone (the
`fetch` tool's mirror or `git clone --bare https://github.com/microsoft/vidur`) and writes the
medians at a set of token counts. No fitting: the numbers are vidur's medians.

    .venv/bin/python benchmarks/serve_vidur_extract.py /work/.mirror/microsoft+vidur/repo
"""
from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.rundir import atomic_write_json  # noqa: E402

GPUS = {"a100": "A100-80GB", "h100": "H100-SXM"}
NETWORK = {"a100": "a100_dgx", "h100": "h100_dgx"}
"""The SXM parts sit in DGX nodes (NVSwitch), as the profiles' intra_node link says."""
# vidur's A100 reads Llama-2-7B's linear weights at up to 1,569 GB/s (> the 40 GB part's 1,555
# GB/s datasheet bandwidth): the 80 GB SXM part; its H100 at 2,680 GB/s (> PCIe's 2,000): SXM
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
LINEAR = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
OTHER = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")


def _csv(repo: str, path: str) -> list[dict]:
    text = subprocess.run(["git", "--git-dir", repo, "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout
    return list(csv.DictReader(io.StringIO(text)))


def all_reduce(rows: list[dict]) -> dict:
    """{tp: {elements, ms}}: workers all in one node (devices_per_node == num_workers), at tokens x
    4096 elements for TOKENS, each the median of the 5 measured sizes nearest in log scale, then
    the running maximum over the sizes."""
    import math
    import statistics
    out = {}
    for tp in ("2", "4", "8"):
        pts = sorted((int(r["size"]), float(r["time_stats.all_reduce.median"])) for r in rows
                     if r["num_workers"] == tp and r["devices_per_node"] == tp)
        if not pts:
            continue
        elements, ms = [], []
        for n in TOKENS:
            e = n * 4096
            near = sorted(pts, key=lambda p: abs(math.log(p[0] / e)))[:5]
            elements.append(e)
            ms.append(round(max([statistics.median(t for _, t in near)] + ms[-1:]), 5))
        out[tp] = {"elements": elements, "ms": ms}
    return out


def main(repo: str) -> None:
    commit = subprocess.run(["git", "--git-dir", repo, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    out = {"source": f"microsoft/vidur at commit {commit}: data/profiling/compute/<gpu>/meta-llama/Llama-2-7b-hf/"
                     "mlp.csv; the median of each measurement "
                     "(benchmarks/serve_vidur_extract.py)",
           "all_reduce_source": f"microsoft/vidur at commit {commit}: data/profiling/network/<gpu>_dgx/all_reduce.csv "
                                "(NCCL, fp16, CUDA graph, one node); per TP degree, at tokens x 4096 elements, the "
                                "median of the 5 measured sizes nearest in log scale, then the running maximum over the sizes",
           "model": {"name": "Llama-2-7b-hf", "hidden": 4096, "ffn_hidden": 11008, "heads": 32, "kv_heads": 32,
                     "linear_weights_per_layer": 4096 * (3 * 4096 + 4096 + 3 * 11008)},
           "devices": {}}
    for gpu, name in GPUS.items():
        rows = _csv(repo, f"data/profiling/compute/{gpu}/meta-llama/Llama-2-7b-hf/mlp.csv")
        dev = {"tp": {}}
        for tp in ("1", "2", "4", "8"):
            by_n = {int(r["num_tokens"]): r for r in rows if r["num_tensor_parallel_workers"] == tp}
            pts = [n for n in TOKENS if n in by_n]
            dev["tp"][tp] = {
                "tokens": pts,
                "linear_ms": [round(sum(float(by_n[n][f"time_stats.{k}.median"]) for k in LINEAR), 5) for n in pts],
                "other_ms": [round(sum(float(by_n[n][f"time_stats.{k}.median"]) for k in OTHER), 5) for n in pts]}
        dev["all_reduce"] = all_reduce(_csv(repo, f"data/profiling/network/{NETWORK[gpu]}/all_reduce.csv"))
        out["devices"][name] = dev
    dest = Path(__file__).resolve().parents[1] / "profiles" / "serving" / "vidur.json"
    atomic_write_json(dest, out)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/.mirror/microsoft+vidur/repo")
