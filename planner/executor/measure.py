"""Measuring one rank: peak memory and model-state bytes.

CPU (method measured in /work/shared/notes/deepspeed-on-cpu.md "Measuring memory on CPU"):
peak resident set size, VmHWM from /proc/self/status, reset after initialisation by writing
5 to /proc/self/clear_refs; ranks run with MALLOC_MMAP_THRESHOLD_=65536 so glibc returns
freed buffers and the high-water mark tracks live memory. It includes the interpreter and
libraries (reported separately as the RSS before the model was built).
GPU: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats.
Model states (both): the bytes of parameters, gradients and optimizer state (fp32 masters,
moments, ZeRO partitions and buckets) this rank holds, counted tensor by tensor with
shared storage counted once -- exact and repeatable.
"""
from __future__ import annotations

from pathlib import Path

import torch

CPU_METHOD = ("VmHWM (peak RSS) after clear_refs reset post-init, MALLOC_MMAP_THRESHOLD_=65536; "
              "model states counted tensor by tensor")
GPU_METHOD = "torch.cuda.max_memory_allocated after reset post-init; model states counted tensor by tensor"


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_bytes(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return _status_kb("VmHWM") * 1024


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _collect(obj, seen_ids: set[int], out: dict[tuple[int, int], int], depth: int) -> None:
    if depth < 0 or id(obj) in seen_ids:
        return
    seen_ids.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            key = _storage_key(obj)
            out[key] = key[1]
        return
    if isinstance(obj, torch.nn.Module):
        return  # modules are counted through their parameters
    if isinstance(obj, dict):
        items = list(obj.values()) + [k for k in obj if isinstance(k, torch.Tensor)]
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
        items = list(vars(obj).values())
    else:
        return
    for v in items:
        _collect(v, seen_ids, out, depth - 1)


def model_state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters (this rank's shard under ZeRO-3), gradients and optimizer state."""
    params: dict[tuple[int, int], int] = {}
    grads: dict[tuple[int, int], int] = {}
    for p in module.parameters():
        shard = getattr(p, "ds_tensor", None)
        t = shard if shard is not None else p.data
        if t.untyped_storage().nbytes():
            k = _storage_key(t)
            params[k] = k[1]
        if p.grad is not None:
            k = _storage_key(p.grad)
            grads[k] = k[1]
    rest: dict[tuple[int, int], int] = {}
    _collect(optimizer, set(), rest, depth=6)
    opt = {k: v for k, v in rest.items() if k not in params and k not in grads}
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optimizer": sum(opt.values())}
