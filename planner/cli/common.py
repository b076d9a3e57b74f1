"""Options shared by several commands, and turning them into specs."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from planner.errors import SpecError
from planner.specs.hardware import ClusterSpec, load_profile, parse_cluster
from planner.specs.model import ModelSpec, preset, scale
from planner.specs.train import ATTENTION, TrainSpec

SCALE_CHOICES = ["full", "tiny", "small"]


def model_options(f: Callable) -> Callable:
    f = click.option("--scale", type=click.Choice(SCALE_CHOICES), default=None,
                     help="Shrink the model (same shape family) to run on a CPU machine.")(f)
    f = click.option("--model", "model_arg", required=True, metavar="NAME|CONFIG.JSON",
                     help="A preset (glm-10b, glm-130b, chatglm-6b, chatglm2-6b, chatglm3-6b, glm-4-9b) "
                          "or a Hugging Face config.json.")(f)
    return f


def cluster_options(f: Callable) -> Callable:
    f = click.option("--memory-headroom", type=float, default=None, metavar="GB",
                     help="GB per GPU left free for CUDA context, NCCL communicator buffers and the allocator's "
                          "reserve, counted in every plan's peak (default: the profile's memory_overhead_gb); "
                          "plans within 2% of the GPU's memory are flagged.")(f)
    f = click.option("--nvme-gbps", type=float, default=None, metavar="GB/S",
                     help="NVMe read/write bandwidth per node for ZeRO-Infinity offload to NVMe "
                          "(default: the profile's host block; 0 = no NVMe).")(f)
    f = click.option("--cpu-mem-gb", type=float, default=None, metavar="GB",
                     help="Host memory per node for offloaded model states (default: the profile's host block).")(f)
    f = click.option("--intra-gbps", type=float, default=None, help="Override intra-node bus bandwidth, GB/s.")(f)
    f = click.option("--inter-latency-us", type=float, default=None, help="Override inter-node latency, us.")(f)
    f = click.option("--inter-gbps", type=float, default=None, help="Override inter-node bus bandwidth, GB/s.")(f)
    f = click.option("--profile", "profile_path", default=None, metavar="PROFILE.JSON",
                     help="A measured profile (planner profile) replacing the built-in one.")(f)
    f = click.option("--gpus", required=True, metavar="[NODESx]GPUSxTYPE",
                     help="e.g. 8xA100, 4x8xH100, 96x8xA100-40GB, 2xcpu.")(f)
    return f


def train_options(f: Callable) -> Callable:
    f = click.option("--attention", type=click.Choice(list(ATTENTION)), default="flash", show_default=True,
                     help="Attention kernel the run uses: flash (torch SDPA, no s x s scores kept, backward "
                          "recomputes them) or eager (softmax stored; selective recompute pays off).")(f)
    f = click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
                     help="Training precision (default bf16, fp16 where bf16 is unsupported).")(f)
    f = click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default min(2048, model max); 128 on cpu).")(f)
    f = click.option("--global-batch", type=int, default=None, help="Sequences per step (default 512; 8 on cpu).")(f)
    return f


def load_model(model_arg: str, size: str | None) -> ModelSpec:
    if model_arg.endswith(".json") or Path(model_arg).exists():
        from planner.specs.hf import load_hf_config
        spec = load_hf_config(model_arg)
    else:
        spec = preset(model_arg)
    return scale(spec, size)


def load_cluster(gpus: str, profile_path: str | None, inter_gbps: float | None,
                 inter_latency_us: float | None, intra_gbps: float | None, *, cpu_mem_gb: float | None = None,
                 nvme_gbps: float | None = None, memory_headroom: float | None = None) -> ClusterSpec:
    for name, v in (("--inter-gbps", inter_gbps), ("--intra-gbps", intra_gbps)):
        if v is not None and not v > 0:
            raise SpecError(name, f"must be positive, got {v}", "give a bandwidth in GB/s")
    if inter_latency_us is not None and not inter_latency_us >= 0:
        raise SpecError("--inter-latency-us", f"must be >= 0, got {inter_latency_us}", "give microseconds")
    # `not v >= 0` also catches nan; inf is no memory size or bandwidth
    if cpu_mem_gb is not None and not (0 <= cpu_mem_gb < float("inf")):
        raise SpecError("--cpu-mem-gb", f"must be a number of GB >= 0, got {cpu_mem_gb}",
                        "give the host memory per node in GB, e.g. 1024 (0: no offload to the host)")
    if nvme_gbps is not None and not (0 <= nvme_gbps < float("inf")):
        raise SpecError("--nvme-gbps", f"must be a bandwidth >= 0, got {nvme_gbps}",
                        "give the NVMe bandwidth per node in GB/s, e.g. 25 (0: no NVMe)")
    if memory_headroom is not None and not (0 <= memory_headroom < float("inf")):
        raise SpecError("--memory-headroom", f"must be GB >= 0, got {memory_headroom}",
                        "give the GB each GPU keeps free, e.g. 2")
    prof = load_profile(profile_path) if profile_path else None
    return parse_cluster(gpus, prof, inter_gbps=inter_gbps, inter_latency_us=inter_latency_us, intra_gbps=intra_gbps,
                         cpu_mem_gb=cpu_mem_gb, nvme_gbps=nvme_gbps, memory_headroom=memory_headroom)


def load_train(model: ModelSpec, cluster: ClusterSpec, global_batch: int | None, seq_len: int | None,
               precision: str | None, attention: str = "flash") -> TrainSpec:
    cpu = cluster.device.kind == "cpu"
    if global_batch is None:
        global_batch = 8 if cpu else 512
    if seq_len is None:
        seq_len = min(128 if cpu else 2048, model.max_seq)
    if precision is None:
        precision = "bf16" if cluster.device.supports("bf16") else "fp16"
    if seq_len > model.max_seq:
        raise SpecError("--seq-len", f"{seq_len} exceeds {model.name}'s maximum sequence {model.max_seq}",
                        f"use --seq-len {model.max_seq} or less")
    return TrainSpec(global_batch=global_batch, seq_len=seq_len, precision=precision, attention=attention)


def load_inputs(kw: dict[str, Any]) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """Pop the shared options from a command's kwargs and build the three specs."""
    model = load_model(kw.pop("model_arg"), kw.pop("scale"))
    cluster = load_cluster(kw.pop("gpus"), kw.pop("profile_path"), kw.pop("inter_gbps"),
                           kw.pop("inter_latency_us"), kw.pop("intra_gbps"), cpu_mem_gb=kw.pop("cpu_mem_gb"),
                           nvme_gbps=kw.pop("nvme_gbps"), memory_headroom=kw.pop("memory_headroom"))
    train = load_train(model, cluster, kw.pop("global_batch"), kw.pop("seq_len"), kw.pop("precision"),
                       kw.pop("attention"))
    return model, cluster, train


def common_inputs(f: Callable) -> Callable:
    """--model/--scale, --gpus/--profile/network/host/--memory-headroom, --global-batch/--seq-len/
    --precision/--attention."""
    return model_options(cluster_options(train_options(f)))


