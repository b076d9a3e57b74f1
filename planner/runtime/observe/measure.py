"""Measuring one rank: peak memory and model-state bytes.

CPU (method measured in /work/shared/notes/deepspeed-on-cpu.md "Measuring memory on CPU"):
peak resident set size, VmHWM from /proc/self/status, reset after initialisation by writing
5 to /proc/self/clear_refs; ranks run with MALLOC_MMAP_THRESHOLD_=65536 so glibc returns
freed buffers and the high-water mark tracks live memory. It includes the interpreter and
libraries (reported separately as the RSS before the model was built).
GPU: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats.
The allocated peak on CPU (live tensor bytes, what a GPU counts): planner/runtime/observe/allocated.py.
Model states (both): the bytes of parameters, gradients and optimizer state (fp32 masters,
moments, ZeRO partitions and buckets) this rank holds, counted tensor by tensor with
shared storage counted once -- exact and repeatable; what DeepSpeed offloads (ZeRO-Offload's
CPU optimizer partition, ZeRO-3's offloaded parameter partition) separately as host-held
(`model_states`).
Activations (worker --measure-activations): the bytes each layer keeps for backward during one
micro-batch of a real training step, ActivationRecorder below.
"""
from __future__ import annotations

import contextlib
import re
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


ROLES = ("params", "grads", "optimizer")
"""Where model_states first places a storage, per location ("device", "host"): parameters and
gradients reached through the module (p.data or ZeRO-3's ds_tensor, hpZ's ds_secondary_tensor,
p.grad), everything else reached through the optimizer under "optimizer"; what DeepSpeed keeps
in its CPU offload structures (`_host_roles`) by what it is. The reported classes are finer
(CLASSES)."""

CLASSES = ("params", "grads", "optimizer", "buckets", "other")
"""The classes model states are reported in: the cost model's buffer roles
(planner.cost.engines.ROLES, the estimate's MemoryBreakdown fields of the same names), so that
predicted - measured is a field-by-field subtraction, and "other" for a storage no rule below
names (its buffer label says what it is)."""

OPTIMIZER_CLASSES = (
    # (in the attribute path under the optimizer, class, the engine buffer it is: planner.cost.engines)
    ("ipg_buckets", "buckets", "reduce bucket(s): stage3.py / stage_1_and_2.py ipg_buckets[dtype].buffer"),
    ("grad_partitions_flat_buffer", "grads", "ZeRO-3 gradient partition (stage3.py)"),
    ("averaged_gradients", "grads", "ZeRO-1 owned gradient partition (stage_1_and_2.py)"),
    ("grads_in_partition", "grads", "ZeRO-2 owned gradient partition (stage_1_and_2.py)"),
    ("fp32_groups_gradients", "grads", "BF16_Optimizer gradient accumulation buffer"),
    ("non_expert_gradients", "grads", "BF16_Optimizer gradient accumulation buffer (its views, reached first)"),
    ("_global_grad_norm", "optimizer", "the optimizer's scalar gradient norm (like Adam's step counters)"),
    ("inf_or_nan_tracker", "optimizer", "ZeRO-3's overflow flag (one byte)"),
    (".grad", "grads", "an fp32 master's .grad: the fp32 gradient partition or copy"),
    ("accumulated_grads", "grads", "ZeRO-2 offload accumulated gradient partition"),
    ("temp_grad_buffer_for_cpu", "grads", "host gradient staging buffer"),
    ("temp_grad_buffer_for_gpu", "optimizer", "device gradient staging buffer"),
    ("state[", "optimizer", "Adam moments and step counters; FP16_Optimizer's fp32 masters as state keys"),
    ("fp32", "optimizer", "fp32 master weights / partition"),
    ("param_buffer_of_bit16", "optimizer", "16-bit partition for the copy back (offload)"),
    ("bit16_groups_flat", "params", "ZeRO-1/2 flat 16-bit weights (the module's weights are views)"),
    ("fp16_groups_flat", "params", "FP16_Optimizer flat 16-bit weights"),
    ("bf16_groups_flat", "params", "BF16_Optimizer flat 16-bit weights"),
)
"""How a storage the optimizer holds is classed, first match wins (DeepSpeed 0.19.8 attribute
names, as `_walk` spells them)."""


def storage_class(role: str, name: str) -> str:
    """The class (CLASSES) of a storage model_states placed under `role` with label `name`
    ("optimizer.<attribute path>", "module.param", ...; "gathered weights ..." for a ZeRO-3
    parameter's p.data the optimizer reaches)."""
    if name.startswith("gathered weights"):
        return "buckets"  # planner.cost.engines _zero3 "gathered weights" (live parameters)
    if name.startswith("persistent weights"):
        return "params"   # _zero3 "persistent small weights"
    if role != "optimizer" or not name.startswith("optimizer."):
        return role
    path = name[len("optimizer."):]
    for pattern, cls, _ in OPTIMIZER_CLASSES:
        if pattern in path:
            return cls
    return "other"


def _host_roles(module: torch.nn.Module, optimizer) -> dict[tuple[int, int], str]:
    """Storages DeepSpeed 0.19.8 keeps on the host because of offload, with their role.

    On a CPU-only machine every tensor is on "cpu", so they are identified by where DeepSpeed
    keeps them (on a GPU these are exactly its tensors allocated on "cpu"):
    - ZeRO-1/2 with offload_optimizer (stage_1_and_2.py, `cpu_offload`): the fp32 master
      partition (single_partition_of_fp32_groups), its Adam state, the 16-bit staging copy of
      the partition (param_buffer_of_bit16_for_cpu_offload_groups) -> optimizer; the fp32
      gradient partition (the master's .grad, offload_gradient_dict views it), the per-parameter
      accumulators of gradient accumulation (accumulated_grads_in_cpu) and the copy buffer of
      one parameter (temp_grad_buffer_for_cpu_offload) -> grads;
    - ZeRO-3 with offload_optimizer (stage3.py, `offload_optimizer`; self.device is "cpu"):
      the fp32 master sub-groups placed on "cpu" (subgroup_to_device) and their Adam state ->
      optimizer; their .grad and the gradient partition buffer grad_partitions_flat_buffer ->
      grads;
    - ZeRO-3 with offload_param (`offload_param`): every parameter's ds_tensor (views of
      param_groups_fp16_flat_cpu_memory) -> params."""
    o = optimizer
    out: dict[tuple[int, int], str] = {}

    def add(role: str, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
                out.setdefault(_storage_key(t), role)

    def state(masters) -> list:
        inner = getattr(o, "optimizer", None)
        st = getattr(inner, "state", {}) if inner is not None else {}
        return [v for m in masters for v in (st.get(m) or {}).values()]

    if getattr(o, "cpu_offload", False):
        masters = list(getattr(o, "single_partition_of_fp32_groups", []))
        add("optimizer", *masters, *state(masters), *getattr(o, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        add("grads", *(m.grad for m in masters), *getattr(o, "accumulated_grads_in_cpu", {}).values(),
            getattr(o, "temp_grad_buffer_for_cpu_offload", None))
    if getattr(o, "offload_optimizer", False) is True:
        on_host = [i for i, d in getattr(o, "subgroup_to_device", {}).items() if str(d) == "cpu"]
        masters = [o.fp32_partitioned_groups_flat[i] for i in on_host]
        add("optimizer", *masters, *state(masters))
        add("grads", *(m.grad for m in masters), getattr(o, "grad_partitions_flat_buffer", None))
    if getattr(o, "offload_param", False) is True:
        add("params", *(p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None))
    return out


_MANGLED = re.compile(r"(^|\.)_[A-Za-z0-9]+__")


def _walk(root, depth: int) -> dict[tuple[int, int], tuple[str, torch.Tensor]]:
    """Every tensor storage reachable from `root` (DeepSpeed/torch objects, containers, tensor
    dict keys, a leaf tensor's .grad) within `depth` steps, breadth first, each named by its
    shortest attribute path with indices folded ("optimizer.state[p][exp_avg]",
    "ipg_buckets[torch.float32].buffer")."""
    found: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    level = [(root, "")]
    for _ in range(depth + 1):
        nxt = []
        for obj, path in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                if obj.device.type != "meta" and obj.untyped_storage().nbytes():
                    found.setdefault(_storage_key(obj), (path, obj))
                if obj.is_leaf and obj.grad is not None:
                    nxt.append((obj.grad, path + ".grad"))
                continue
            if isinstance(obj, torch.nn.Module):
                continue  # modules are counted through their parameters
            if isinstance(obj, dict):
                items = [(f"[{'p' if isinstance(k, torch.Tensor) else 'i' if isinstance(k, int) else k}]", v)
                         for k, v in obj.items()]
                items += [("[key]", k) for k in obj if isinstance(k, torch.Tensor)]
            elif isinstance(obj, (list, tuple, set)):
                items = [("[i]", v) for v in obj]
            elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
                items = [("." + k, v) for k, v in vars(obj).items()]
            else:
                continue
            nxt += [(v, path + k) for k, v in items]
        level = nxt
    return {k: (_MANGLED.sub(r"\1__", p.lstrip(".")), t) for k, (p, t) in found.items()}


def model_states(module: torch.nn.Module, optimizer, device: str = "cpu") -> dict:
    """This rank's model states by location and class, in bytes, each storage counted once:
    {"device": {params, grads, optimizer, buckets, other}, "host": {...the same},
     "buffers": {"<location>.<class>:<where DeepSpeed keeps it>": bytes}}.

    The classes are the cost model's (CLASSES, storage_class): module parameters (this rank's
    ZeRO-3 shard, hpZ's secondary shard, ZeRO-3's persistent weights) are params; module
    gradients and the gradient partitions and fp32 gradient copies the optimizer holds are
    grads; fp32 masters and Adam state are optimizer; reduce buckets and ZeRO-3's live gathered
    weights are buckets. "host" is what DeepSpeed offloads (`_host_roles`; on a GPU also
    anything else the optimizer holds on the CPU)."""
    host = _host_roles(module, optimizer)
    where: dict[tuple[int, int], tuple[str, str, str]] = {}  # key -> (location, role, name)

    def place(t: torch.Tensor, role: str, name: str) -> None:
        if t.device.type == "meta" or not t.untyped_storage().nbytes():
            return
        k = _storage_key(t)
        if k in where:
            return
        # on a GPU any tensor on the CPU is host-held, whatever DeepSpeed calls it
        on_host = k in host or (device != "cpu" and t.device.type == "cpu")
        where[k] = ("host" if on_host else "device", host.get(k, role), name)

    for p in module.parameters():
        shard = getattr(p, "ds_tensor", None)
        if shard is not None:
            place(shard, "params", "module.ds_tensor")
        else:
            place(p.data, "params", "module.param")
        secondary = getattr(p, "ds_secondary_tensor", None)
        if secondary is not None:  # ZeRO++ hpZ: the weights partitioned again inside the hpZ group
            place(secondary, "params", "module.ds_secondary_tensor")
        if p.grad is not None:
            place(p.grad, "grads", "module.grad")
    for name, t in _walk(optimizer, depth=6).values():
        if isinstance(t, torch.nn.Parameter):  # p.data beside its ds_tensor: ZeRO-3 keeps it gathered
            name = ("persistent weights (ZeRO-3, kept gathered)" if getattr(t, "ds_persist", False)
                    else "gathered weights (ZeRO-3, live)")
            place(t, "optimizer", name)
            continue
        place(t, "optimizer", "optimizer." + name)
    out: dict = {"device": dict.fromkeys(CLASSES, 0), "host": dict.fromkeys(CLASSES, 0), "buffers": {}}
    for (_, nbytes), (loc, role, name) in where.items():
        cls = storage_class(role, name)
        out[loc][cls] += nbytes
        label = f"{loc}.{cls}:{name}"
        out["buffers"][label] = out["buffers"].get(label, 0) + nbytes
    return out


def model_state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """Device-held bytes per class (model_states(...)["device"])."""
    return model_states(module, optimizer)["device"]


class ActivationRecorder:
    """What each layer of this rank keeps for backward during one micro-batch's forward (and
    its loss): saved-tensor hooks, plus the inputs DeepSpeed's activation checkpointing holds
    as ctx attributes, which the hooks do not see (recorded where the executor's model calls
    the checkpoint, as planner.model.recompute.saved_for_backward does). Storages count once;
    parameters are left out (also ZeRO-3's gathered weights and the Parameter objects its
    linear saves).

    Each storage is attributed to the layer running when it was kept: "embedding" (word and
    position embedding), "block<i>" (global block index), "head" (final norm, output layer,
    loss). What more than one layer keeps, what the stage cache hands out (mask, cos/sin) and
    the micro-batch's position/segment ids are the stage's "shared" part (docs/runtime.md).
    `result` after a window: {"blocks": {i: bytes}, "shared", "embedding", "head"}."""

    def __init__(self, module: torch.nn.Module) -> None:
        from planner.model import recompute
        from planner.model.block import Block
        from planner.model.embedding import PositionEmbedding, WordEmbedding
        from planner.model.head import FinalNorm, OutputLayer
        self._recompute = recompute
        self.params = list(module.parameters())
        self.result: dict | None = None
        self.active = False
        self._kept: dict[int, list] = {}
        self._shared: dict[int, weakref.ref] = {}
        self._label = "embedding"
        self._caches: dict[int, object] = {}
        for m in module.modules():
            label = None
            if isinstance(m, (WordEmbedding, PositionEmbedding)):
                label = "embedding"
            elif isinstance(m, Block):
                label = f"block{m.layer}"
                self._caches[id(m.self_attention.cache)] = m.self_attention.cache
            elif isinstance(m, (FinalNorm, OutputLayer)):
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
        R = self._recompute
        self._kept, self._shared, self._label, self.active = {}, {}, "embedding", True
        run_checkpoint = R.checkpoint
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
        R.checkpoint = checkpoint_keeping_inputs
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._keep, lambda t: t):
                yield
        finally:
            R.checkpoint = run_checkpoint
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
