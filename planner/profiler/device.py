"""The machine being profiled: CUDA GPU when present, else the CPU; versions and memory."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Where kernels run: torch device string, kind (gpu|cpu) and how to wait for it."""

    device: str
    kind: str
    name: str

    def sync(self) -> None:
        if self.kind == "gpu":
            import torch
            torch.cuda.synchronize()


def detect(force_cpu: bool = False) -> Target:
    import torch
    if not force_cpu and torch.cuda.is_available():
        return Target(device="cuda", kind="gpu", name=torch.cuda.get_device_name(0))
    return Target(device="cpu", kind="cpu", name=cpu_name())


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), as profiles record it."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_memory_gb() -> float:
    """MemTotal from /proc/meminfo in GB (1e9 bytes); os.sysconf elsewhere."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def memory_gb(target: Target) -> float:
    if target.kind == "gpu":
        import torch
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return host_memory_gb()


def devices_per_node(target: Target, procs: int) -> int:
    if target.kind == "gpu":
        import torch
        return torch.cuda.device_count()
    return procs


def environment(target: Target) -> dict[str, Any]:
    """Device, driver and library versions, and the date: recorded in every measured profile."""
    import torch
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "device": target.name, "kind": target.kind,
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:  # version only: importing deepspeed costs seconds and prints accelerator warnings
        env["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        env["deepspeed"] = None
    if target.kind == "gpu":
        props = torch.cuda.get_device_properties(0)
        env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpu_count=torch.cuda.device_count(), compute_capability=f"{props.major}.{props.minor}",
                   driver=_nvidia_driver())
    return env


def _nvidia_driver() -> str | None:
    try:
        return open("/proc/driver/nvidia/version").readline().strip()
    except OSError:
        return None


EXECUTOR_MMAP_THRESHOLD = 65536
"""glibc's mmap threshold the executor's CPU ranks run with (planner/runtime/train/launch.py
rank_environment: MALLOC_MMAP_THRESHOLD_=65536, so a freed tensor goes back to the OS and peak
RSS means something). Every allocation of 64 KiB or more is then a fresh mmap whose pages
fault in on first touch and are unmapped on free: measured here (chatglm3-6b tiny, block
forward + backward, 1 thread) 18.6 ms -> 37.9 ms at micro-batch 4 x 256 in bf16, 5.9 -> 8.2 ms
at 2 x 128. A CPU probe timed under glibc's default (a heap that keeps freed memory) misses
that cost, which grows with the bytes a step allocates."""


def executor_allocator() -> bool:
    """Put this process, and the processes it starts from now on, under the executor's allocator
    setting (EXECUTOR_MMAP_THRESHOLD): mallopt(M_MMAP_THRESHOLD) here -- what glibc does for the
    MALLOC_MMAP_THRESHOLD_ variable at start-up, the dynamic threshold switched off too -- and
    the variable in os.environ for children. False where there is no glibc (the variable is
    still set)."""
    import ctypes
    import ctypes.util
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(EXECUTOR_MMAP_THRESHOLD)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_mmap_threshold = -3  # malloc.h
        return bool(libc.mallopt(m_mmap_threshold, EXECUTOR_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
