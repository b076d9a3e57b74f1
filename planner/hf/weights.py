"""Hugging Face checkpoints in and out of the executor's (TP- and PP-sharded) model.

The families' layouts (tensor names, fused q|k|v and gate|up parts, shapes, config.json) and
the header-only check of a checkpoint (check_checkpoint, which check_hf_checkpoint below runs
alone) are planner/hf/layout.py; its public names are re-exported here.

Loading runs on every rank before deepspeed.initialize (so ZeRO-3 partitions the loaded
values): each rank checks the whole checkpoint (config against the plan's model, every
tensor's presence and shape; only headers are read, so every rank reaches the same verdict)
and then reads only its own slices (safetensors get_slice): its pipeline stage's layers, its
1/T of every fused part, its rows of the padded vocabulary (padded rows are zero). Saving
gathers ZeRO-3 partitions (GatheredParameters), TP slices (all-gather over the TP group) and
pipeline stages (point-to-point to rank 0), and rank 0 writes one model.safetensors and a
config.json into a temporary directory that is then renamed into place.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from planner.errors import ExecutionError
from planner.hf.layout import (COMPARED, FIELD, INDEX, LAYOUTS, Checkpoint, canonical_names, check_checkpoint,
                               check_supported, expected_tensors, full_shape, hf_config, layout_for, save_layout,
                               sources, to_hf)
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.specs.model import ModelSpec

__all__ = ["COMPARED", "COPIED_SUFFIXES", "FIELD", "INDEX", "LAYOUTS", "Checkpoint", "canonical_names",
           "check_checkpoint", "check_hf_checkpoint", "check_supported", "expected_tensors", "full_shape",
           "gather_experts", "gather_full", "hf_config", "layout_for", "load_hf_weights", "local_tensor", "module_tp",
           "named_buffers", "save_hf_weights", "save_layout", "sources", "to_hf", "write_checkpoint"]

COPIED_SUFFIXES = (".json", ".py", ".model", ".txt", ".tiktoken")
"""Non-weight files of the source directory (tokenizer, generation config, remote code) copied
next to a saved checkpoint; the safetensors index is rewritten, not copied."""


def check_hf_checkpoint(path: str | Path, spec: ModelSpec, field: str = FIELD) -> str:
    """Everything load_hf_weights checks before reading a value (config against the plan's model,
    every tensor's presence and shape; headers only, fast): for a launcher's preflight. Returns
    the layout."""
    ckpt = Checkpoint(path, field)
    try:
        return check_checkpoint(ckpt, spec)
    finally:
        ckpt.close()


# --- loading ----------------------------------------------------------------------------------------


def module_tp(module: torch.nn.Module) -> TPGroup:
    """The TP group the module's layers were built with."""
    for m in module.modules():
        tp = getattr(m, "tp", None)
        if isinstance(tp, TPGroup):
            return tp
    return SINGLE


def _local_ranges(p: torch.nn.Parameter, tp: TPGroup) -> tuple[int | None, list[tuple[int, int]]]:
    """(split dim, this rank's [lo, hi) ranges along it in the unsplit parameter, part by part)."""
    split = getattr(p, "tp_split", None)
    if split is None:
        return None, []
    dim, parts = split
    out, off = [], 0
    for n in parts:
        k = n // tp.size
        out.append((off + tp.rank * k, off + (tp.rank + 1) * k))
        off += n
    return dim, out


def _read_rows(ckpt: Checkpoint, srcs: list[tuple[str, int]], lo: int, hi: int, dim: int) -> list[torch.Tensor]:
    """[lo, hi) along `dim` of the concatenation (along dim 0) of `srcs`."""
    if dim == 1:
        assert len(srcs) == 1, srcs
        return [ckpt.read(srcs[0][0], 1, lo, hi)]
    pieces, off = [], 0
    for name, rows in srcs:
        a, b = max(lo, off), min(hi, off + rows)
        if a < b:
            pieces.append(ckpt.read(name, 0, a - off, b - off))
        off += rows
    return pieces


def local_tensor(ckpt: Checkpoint, p: torch.nn.Parameter, spec: ModelSpec, layout: str, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of parameter `p` (TP split, padded vocabulary rows zero), read from the checkpoint."""
    srcs = sources(p.canonical, spec, layout)
    dim, ranges = _local_ranges(p, tp)
    if dim is None:
        return ckpt.read(srcs[0][0]) if len(srcs) == 1 else torch.cat([ckpt.read(n) for n, _ in srcs])
    real = sum(r for _, r in srcs) if dim == 0 else full_shape(p.canonical, spec)[1]
    pieces = []
    for lo, hi in ranges:
        got = _read_rows(ckpt, srcs, min(lo, real), min(hi, real), dim)
        pad = hi - max(lo, real)  # padded vocabulary rows
        if pad > 0:
            shape = list(p.shape)
            shape[dim] = pad
            got.append(torch.zeros(shape, dtype=got[0].dtype if got else p.dtype))
        pieces += got
    return torch.cat(pieces, dim)


def named_buffers(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of the buffers a checkpoint holds: a MoE router's balancing bias
    (planner/model/moe.py Router.canonical_buffers), whole on every rank."""
    for m in module.modules():
        for attr, canonical in getattr(m, "canonical_buffers", {}).items():
            yield canonical, getattr(m, attr)


def load_hf_weights(module: torch.nn.Module, path: str | Path, spec: ModelSpec, groups=None) -> None:
    """Load the checkpoint at `path` into this rank's module (before deepspeed.initialize).
    `groups` (planner.model.parallel.groups.Groups) may be None: the TP rank is then read
    from the module's layers. A MoE rank reads its own experts (those its module holds)."""
    tp = groups.tp if groups is not None else module_tp(module)
    ckpt = Checkpoint(path)
    try:
        layout = check_checkpoint(ckpt, spec)
        with torch.no_grad():
            for p in module.parameters():
                value = local_tensor(ckpt, p, spec, layout, tp)
                if tuple(value.shape) != tuple(p.shape):  # the checks above make this a bug, not bad input
                    raise ExecutionError(FIELD, f"{p.canonical}: read {list(value.shape)}, the rank holds "
                                         f"{list(p.shape)}", "report this as a bug")
                p.copy_(value.to(p.dtype))
            for canonical, buf in named_buffers(module):
                buf.copy_(ckpt.read(sources(canonical, spec, layout)[0][0]).to(buf.dtype))
    finally:
        ckpt.close()


# --- saving -------------------------------------------------------------------------------------------


def _gather_tp(t: torch.Tensor, p: torch.nn.Parameter, tp: TPGroup) -> torch.Tensor:
    """The unsplit parameter from the TP ranks' slices, part by part."""
    split = getattr(p, "tp_split", None)
    if split is None or tp.size == 1:
        return t
    import torch.distributed as dist
    dim, parts = split
    slices = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(slices, t.contiguous(), group=tp.group)
    chunks = [s.split([n // tp.size for n in parts], dim) for s in slices]
    return torch.cat([chunks[r][i] for i in range(len(parts)) for r in range(tp.size)], dim)


def _params(module: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    seen = set()
    for p in module.parameters():
        if hasattr(p, "canonical") and id(p) not in seen:
            seen.add(id(p))
            yield p


def gather_full(module: torch.nn.Module, spec: ModelSpec, groups, zero3: bool = False) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters, unsplit (ZeRO-3 gathered over DP, TP slices
    concatenated, vocabulary padding dropped), keyed by canonical name. Collective over the
    stage's DP x TP ranks; the result is complete on every rank of the stage."""
    out: dict[str, torch.Tensor] = {}
    tp = groups.tp if groups is not None else module_tp(module)
    for p in _params(module):
        ctx = contextlib.nullcontext()
        if zero3:
            import deepspeed
            ctx = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
        with ctx, torch.no_grad():
            full = _gather_tp(p.detach().clone(), p, tp).cpu()
        if p.canonical in ("embedding.word_embeddings.weight", "head.output_layer.weight"):
            full = full[:spec.vocab]
        out.setdefault(p.canonical, full)
    for canonical, buf in named_buffers(module):
        out.setdefault(canonical, buf.detach().clone().cpu())
    return out


def gather_experts(module: torch.nn.Module, ep) -> dict[str, torch.Tensor]:
    """Every routed expert of this stage's MoE blocks, whole, from the expert-parallel group
    (each EP rank holds experts / ep of them, whole: planner/model/moe.py). Collective over the
    EP group `ep` (a TPGroup); every rank of the group gets all of them."""
    mine = {p.canonical: p.detach().clone().cpu() for p in _params(module) if ".mlp.experts." in p.canonical}
    if ep is None or ep.size == 1:
        return mine
    import torch.distributed as dist
    box: list[Any] = [None] * ep.size
    dist.all_gather_object(box, mine, group=ep.group)
    return {k: v for part in box for k, v in part.items()}


def write_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | bytes,
                     source: str | Path | None = None) -> None:
    """model.safetensors + config.json (+ the source's tokenizer and other small files) into a
    temporary sibling directory, renamed to `path` when complete (an existing `path` is replaced)."""
    from safetensors.torch import save_file
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if source is not None:
            for f in sorted(Path(source).iterdir()):
                if f.is_file() and f.suffix in COPIED_SUFFIXES and f.name not in (INDEX, "config.json") \
                        and not f.name.endswith(".index.json"):
                    shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        data = config if isinstance(config, bytes) else (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        (tmp / "config.json").write_bytes(data)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def save_hf_weights(engine, path: str | Path, spec: ModelSpec, plan, groups, *,
                    source: str | Path | None = None) -> None:
    """Called by every rank after training: gather the model and let rank 0 write one merged
    checkpoint at `path`, in the source's layout (its config.json copied) or, without a source,
    in the model family's layout with a generated config.json. Returns on every rank once
    the checkpoint is in place; raises ExecutionError on every rank when rank 0 could not write it."""
    import torch.distributed as dist
    module = engine.module
    layout = save_layout(spec, source)
    pp_rank = groups.pp_rank if groups is not None else 0
    dp_rank = groups.dp_rank if groups is not None else 0
    tp_rank = groups.tp_rank if groups is not None else 0
    full = gather_full(module, spec, groups, zero3=plan.zero == 3) if dp_rank == 0 or plan.zero == 3 else {}
    ep = getattr(groups, "ep", None)
    if ep is not None and ep.size > 1:  # every rank: the all-gather is over each EP group
        experts = gather_experts(module, ep)
        if dp_rank == 0:
            full.update(experts)
    rank = dist.get_rank() if dist.is_initialized() else 0
    leader = dp_rank == 0 and tp_rank == 0  # one rank per pipeline stage sends its stage
    if plan.pp > 1:
        stage_size = plan.dp * plan.tp
        if leader and pp_rank > 0:
            dist.send_object_list([full], dst=0)
        elif rank == 0:
            for s in range(1, plan.pp):
                box: list[Any] = [None]
                dist.recv_object_list(box, src=s * stage_size)
                for k, v in box[0].items():
                    full.setdefault(k, v)
    error = ""
    if rank == 0:
        try:
            config: dict[str, Any] | bytes = (Path(source) / "config.json").read_bytes() if source is not None \
                else hf_config(spec, layout)
            write_checkpoint(path, to_hf(full, spec, layout), config, source)
        except (OSError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ExecutionError("--save-hf", f"could not write {path}: {error}",
                             "free disk space or pick a writable --save-hf")
