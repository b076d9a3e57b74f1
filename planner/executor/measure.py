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
Activations (worker --measure-activations): the bytes each layer keeps for backward during one
micro-batch of a real training step, ActivationRecorder below.
"""
from __future__ import annotations

import contextlib
import weakref
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


class ActivationRecorder:
    """What each layer of this rank keeps for backward during one micro-batch's forward (and
    its loss): saved-tensor hooks, plus the inputs DeepSpeed's activation checkpointing holds
    as ctx attributes, which the hooks do not see (recorded where the executor's model calls
    the checkpoint, as planner.executor.model.saved_for_backward does). Storages count once;
    parameters are left out (also ZeRO-3's gathered weights and the Parameter objects its
    linear saves).

    Each storage is attributed to the layer running when it was kept: "embedding" (word and
    position embedding), "block<i>" (global block index), "head" (final norm, output layer,
    loss). What more than one layer keeps, what the stage cache hands out (mask, cos/sin) and
    the micro-batch's position/segment ids are the stage's "shared" part (docs/runtime.md).
    `result` after a window: {"blocks": {i: bytes}, "shared", "embedding", "head"}."""

    def __init__(self, module: torch.nn.Module) -> None:
        from planner.executor import model as M
        self._model = M
        self.params = list(module.parameters())
        self.result: dict | None = None
        self.active = False
        self._kept: dict[int, list] = {}
        self._shared: dict[int, weakref.ref] = {}
        self._label = "embedding"
        self._caches: dict[int, object] = {}
        for m in module.modules():
            label = None
            if isinstance(m, (M.WordEmbedding, M.PositionEmbedding)):
                label = "embedding"
            elif isinstance(m, M.Block):
                label = f"block{m.layer}"
                self._caches[id(m.self_attention.cache)] = m.self_attention.cache
            elif isinstance(m, (M.FinalNorm, M.OutputLayer)):
                label = "head"
            if label is not None:
                m.register_forward_pre_hook(self._enter(label))

    def _enter(self, label: str):
        def hook(module, args):
            if self.active:
                self._label = label
                if label.startswith("block"):
                    self._share(t for t in args[0][1:] if torch.is_tensor(t))  # positions, segments
        return hook

    def _share(self, tensors) -> None:
        for t in tensors:
            self._shared[_ptr(t)] = weakref.ref(t)

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0 or ptr in {_ptr(p) for p in self.params}:  # ZeRO-3 swaps p.data: look each time
            return t
        entry = self._kept.setdefault(ptr, [0, set()])
        entry[0] = max(entry[0], st.nbytes())
        entry[1].add(self._label)
        return t

    @contextlib.contextmanager
    def window(self):
        """Record the forward (and loss) run inside: one micro-batch of this rank's stage."""
        M = self._model
        self._kept, self._shared, self._label, self.active = {}, {}, "embedding", True
        run_checkpoint = M._checkpoint
        gets = {}

        def checkpoint_keeping_inputs(fn, *args):
            for a in args:
                if torch.is_tensor(a):
                    self._keep(a)
            return run_checkpoint(fn, *args)

        for key, cache in self._caches.items():
            gets[key] = cache.get

            def recording_get(*a, _get=cache.get, **kw):
                out = _get(*a, **kw)
                self._share(out.values())
                return out
            cache.get = recording_get
        M._checkpoint = checkpoint_keeping_inputs
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._keep, lambda t: t):
                yield
        finally:
            M._checkpoint = run_checkpoint
            for key, cache in self._caches.items():
                del cache.get  # the class's method again
            self.active = False
        out: dict = {"blocks": {}, "shared": 0, "embedding": 0, "head": 0}
        # a shared tensor freed during the window (a checkpointed block's mask) may have left its
        # address to a tensor kept later: only the live ones count
        shared = {ptr for ptr, ref in self._shared.items() if ref() is not None}
        for ptr, (nbytes, labels) in self._kept.items():
            if ptr in shared or len(labels) > 1:
                out["shared"] += nbytes
            else:
                (label,) = labels
                if label.startswith("block"):
                    i = label[len("block"):]  # the global block index (a JSON key)
                    out["blocks"][i] = out["blocks"].get(i, 0) + nbytes
                else:
                    out[label] += nbytes
        self.result = out
        self._kept = {}


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
