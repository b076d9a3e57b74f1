"""Refuse, before any rank starts, what cannot run here (issue 8, point 7 and "Bad input").

`planner run` and `planner verify` call `check` before they touch the run directory, so a
refusal leaves nothing behind: no rank, no .ranks/ directory, no log. Every refusal is one
line naming the field and the fix (SpecError for the run directory's files, ExecutionError
for this host); the CLI prints it and exits 2. In order:

1. The plan (plan.json): the plan rules of planner.specs.validate, each a Problem naming its
   field: the structural ones (plan_problems: world size vs cluster, TP dividing the heads, KV
   groups and FFN, stage split, global batch, ...), what DeepSpeed itself cannot run
   (runtime_problems; the ZeRO variants DeepSpeed 0.19.8 cannot run here come first), and what
   the executor does not run (executor_problems: a vocabulary TP cannot split, MoE / CP layers,
   several nodes).
2. ds_config.json against plan.json: the worker builds the model from plan.json but hands
   DeepSpeed ds_config.json, so a hand edit of one would run a different layout from the one
   the other (and the estimate) describes. Compared: the batch triple (hence the DP degree),
   the ZeRO stage, the precision, the pipeline stages and stage split, and an AutoTP block.
3. This host (skipped by `ignore_host=True`, `planner run --ignore-host-checks`): a GPU plan
   needs as many CUDA devices as it has ranks, each with at least the predicted per-GPU peak;
   a CPU plan's predicted memory, summed over its ranks, must fit in HOST_MEMORY_FRACTION of
   MemAvailable, and it may have at most RANKS_PER_CORE ranks per usable core.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import ExecutionError, SpecError
from planner.specs.estimate import GB
from planner.specs.hardware import DeviceProfile, find_device
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.problems import Problem
from planner.specs.validate import executor_problems, plan_problems, runtime_problems

def lab_limit(device: DeviceProfile, name: str) -> float:
    """A limit observed on the CPU lab host (profiles/cpu.json "lab", with its source): the
    device profile's, else the built-in cpu profile's."""
    return float(device.lab.get(name) or find_device("cpu")[0].lab[name])


HOST_MEMORY_FRACTION = float(find_device("cpu")[0].lab["host_memory_fraction"])
"""A CPU plan's predicted peak memory, summed over its ranks, may use at most this share of
the host's MemAvailable (profiles/cpu.json lab.host_memory_fraction says how it was measured)."""

RANKS_PER_CORE = int(find_device("cpu")[0].lab["ranks_per_core"])
"""Most ranks per usable core (profiles/cpu.json lab.ranks_per_core: the most measured to train)."""

REWRITE = ("make the two agree: delete ds_config.json (`planner run` writes it again from plan.json), "
           "edit that field back, or re-plan with `planner search`")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """What this machine offers the ranks (probe_host measures it; tests pass their own)."""

    cores: int
    """CPU cores this process may run on (sched_getaffinity)."""
    mem_available_bytes: float | None
    """/proc/meminfo MemAvailable; None where it cannot be read."""
    cuda_devices: tuple[tuple[str, float], ...] = ()
    """(name, total memory in bytes) per visible CUDA device."""
    cuda_note: str = ""
    """Why there is no CUDA device, e.g. "torch 2.13.0+cpu is built without CUDA"."""


_CUDA_PROBE = """
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": []}
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append([p.name, p.total_memory])
print(json.dumps(out))
"""


def _mem_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _probe_cuda() -> tuple[tuple[tuple[str, float], ...], str]:
    """CUDA devices as the ranks will see them. Asked in a child process, so that no CUDA
    context lives on in the launcher while the ranks use the devices."""
    try:
        res = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=120,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"the CUDA probe failed ({type(exc).__name__})"
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return (), f"the CUDA probe failed: {tail}"
    try:
        out = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return (), "the CUDA probe printed no result"
    devices = tuple((str(n), float(m)) for n, m in out["devices"])
    if devices:
        return devices, ""
    if not out.get("cuda"):
        return (), f"torch {out['torch']} is built without CUDA"
    return (), f"torch {out['torch']} (CUDA {out['cuda']}) sees no CUDA device"


def probe_host(gpu: bool) -> Host:
    """This machine: usable cores, MemAvailable and, for a GPU plan, its CUDA devices."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    devices, note = _probe_cuda() if gpu else ((), "")
    return Host(cores=cores, mem_available_bytes=_mem_available(), cuda_devices=devices, cuda_note=note)


# --- 1. the plan ------------------------------------------------------------------------------

REPLAN = "re-plan with `planner search`, or correct the hand edit of plan.json"
DEEPSPEED_CANNOT = ("deepspeed-mics", "zeropp-cpu")
"""The ZeRO variants DeepSpeed 0.19.8 cannot run here, refused first with the most specific words.
Measured through the executor (docs/runtime.md "ZeRO variants on CPU",
tests/integration/test_zero_variants.py): MiCS is gone from DeepSpeed 0.19.8 (its config
refuses mics_shard_size on every device); ZeRO++'s quantized weights and gradients load
DeepSpeed's quantizer kernels (QuantizerBuilder), which the CPU accelerator does not have.
Optimizer and parameter offload to the CPU and hpZ run."""


def _field(p: Problem) -> str:
    return p.field if p.field == "cluster" else f"plan.json {p.field}"


def check_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> None:
    """The plan rules (planner.specs.validate), in the order a user meets them."""
    problems = plan_problems(model, cluster, train, plan)
    unsupported = runtime_problems(plan)
    cannot = [p for p in unsupported + problems if p.code in DEEPSPEED_CANNOT]
    if cannot:
        raise cannot[0].error(ExecutionError, field=_field(cannot[0]))
    if problems:
        raise SpecError(_field(problems[0]), problems[0].line, REPLAN)
    for p in executor_problems(model, cluster, plan)[:1]:
        if p.code == "tp-vocab":
            raise p.error(SpecError, field=_field(p))
    if unsupported and plan.runtime != "deepspeed":
        raise ExecutionError("plan.json plan.runtime", unsupported[0].message,
                             "re-plan with `planner search --runtime deepspeed`, or run it under "
                             f"{plan.runtime} (docs/runtimes.md)")
    if unsupported:
        raise unsupported[0].error(ExecutionError, field="plan.json",
                                   fix="plan without --megatron-features, or run it under Megatron-LM")
    for p in executor_problems(model, cluster, plan):
        raise p.error(ExecutionError, field="plan.json" if p.code == "executor-layers" else _field(p))


# --- 2. ds_config.json against plan.json --------------------------------------------------------

def _int_field(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SpecError(f"ds_config.json {key}", f"must be a positive integer, got {v!r}", REWRITE)
    return v


def _batch_triple(cfg: dict[str, Any], dp: int) -> tuple[int, int, int]:
    """(train_batch_size, micro-batch, accumulation) as DeepSpeed completes them for a DP
    degree `dp` (deepspeed/runtime/config.py, DeepSpeedConfig._set_batch_related_parameters)."""
    tb, mb, ga = (_int_field(cfg, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // dp
    elif tb is not None and ga is not None and mb is None:
        mb = tb // dp // ga
    elif mb is not None and ga is not None and tb is None:
        tb = mb * ga * dp
    elif tb is not None and mb is None and ga is None:
        ga, mb = 1, tb // dp
    elif mb is not None and tb is None and ga is None:
        tb, ga = mb * dp, 1
    elif tb is None and mb is None:
        raise SpecError("ds_config.json train_batch_size", "neither it nor train_micro_batch_size_per_gpu is set",
                        REWRITE)
    return tb, mb, ga  # type: ignore[return-value]


def _precision(cfg: dict[str, Any]) -> str:
    def on(key: str) -> bool:
        block = cfg.get(key)
        return isinstance(block, dict) and bool(block.get("enabled", False))
    bf16, fp16 = on("bf16") or on("bfloat16"), on("fp16")
    if bf16 and fp16:
        raise SpecError("ds_config.json bf16.enabled/fp16.enabled", "both are enabled", REWRITE)
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def check_config(cfg: Any, plan: Plan, model: ModelSpec, expected: dict[str, Any]) -> None:
    """ds_config.json must describe the layout plan.json describes; `expected` is what
    planner.dsconfig.ds_config writes for the plan. The first mismatching field is named."""
    if not isinstance(cfg, dict):
        raise SpecError("ds_config.json", "is not a JSON object", REWRITE)
    if "tensor_parallel" in cfg and "tensor_parallel" not in expected:
        raise SpecError("ds_config.json tensor_parallel",
                        "is a DeepSpeed AutoTP block, but AutoTP is not what the plan runs: tensor parallelism is "
                        "the executor's own Megatron-style layers (planner/model/parallel)",
                        "delete the tensor_parallel block (or the whole ds_config.json: `planner run` writes it "
                        "again from plan.json)")
    tb, mb, ga = _batch_triple(cfg, plan.dp)
    if mb != plan.micro_batch:
        raise SpecError("ds_config.json train_micro_batch_size_per_gpu",
                        f"is {mb}, plan.json has micro_batch {plan.micro_batch}", REWRITE)
    if ga != plan.grad_accum:
        raise SpecError("ds_config.json gradient_accumulation_steps",
                        f"is {ga}, plan.json has grad_accum {plan.grad_accum}", REWRITE)
    if tb != plan.global_batch:
        dp = f"DP {tb // (mb * ga)}" if tb % (mb * ga) == 0 else "no whole DP degree"
        raise SpecError("ds_config.json train_batch_size",
                        f"is {tb} = micro-batch {mb} x accumulation {ga} x {dp}, but plan.json has DP {plan.dp} "
                        f"(global batch {plan.global_batch})", REWRITE)
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    if stage != plan.zero:
        raise SpecError("ds_config.json zero_optimization.stage", f"is {stage!r}, plan.json has zero {plan.zero}",
                        REWRITE)
    prec = _precision(cfg)
    if prec != plan.precision:
        what = "neither is enabled (fp32)" if prec == "fp32" else f"select {prec}"
        raise SpecError("ds_config.json bf16.enabled/fp16.enabled",
                        f"{what}, plan.json has precision {plan.precision}", REWRITE)
    pipe = cfg.get("pipeline") if isinstance(cfg.get("pipeline"), dict) else {}
    stages = pipe.get("stages")
    if (plan.pp > 1 and stages != plan.pp) or (plan.pp == 1 and stages not in (None, "auto", 1)):
        raise SpecError("ds_config.json pipeline.stages",
                        f"is {stages!r}, plan.json has pp {plan.pp}", REWRITE)
    split = list(plan.layers_per_stage(model.layers))
    if plan.pp > 1 and "stage_layers" in pipe and pipe["stage_layers"] != split:
        raise SpecError("ds_config.json pipeline.stage_layers",
                        f"is {pipe['stage_layers']!r}, plan.json splits the {model.layers} blocks {split}", REWRITE)


# --- 3. this host ------------------------------------------------------------------------------

def _replan_hint(doc: dict[str, Any], ranks: int) -> str:
    model_arg = (doc.get("inputs") or {}).get("model_arg") or "MODEL"
    return f"`planner search --model {model_arg} --gpus {ranks}xcpu --scale tiny`"


def check_host(plan: Plan, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, host: Host,
               doc: dict[str, Any]) -> None:
    from planner.cost import estimate
    est = estimate(model, cluster, train, plan)
    world = plan.world_size
    if cluster.device.kind != "cpu":
        need = est.peak_memory_bytes
        want = f"{world} CUDA device(s) with {need / GB:.1f} GB each (predicted peak on {cluster.device.name})"
        if not host.cuda_devices:
            raise ExecutionError("plan.json cluster", f"plan needs {want}, this host has none ({host.cuda_note})",
                                 f"run it on a GPU node with {world} GPUs, or re-plan for this machine with "
                                 f"{_replan_hint(doc, min(world, 2))}")
        if len(host.cuda_devices) < world:
            raise ExecutionError("plan.json cluster", f"plan needs {want}, this host has {len(host.cuda_devices)} "
                                 f"({host.cuda_devices[0][0]})",
                                 f"run it on a node with {world} GPUs, or re-plan with "
                                 f"`planner search ... --gpus {len(host.cuda_devices)}x{cluster.device.name}`")
        for i, (name, total) in enumerate(host.cuda_devices[:world]):
            if total < need:
                raise ExecutionError("plan.json cluster",
                                     f"plan predicts a peak of {need / GB:.1f} GB per GPU, CUDA device {i} ({name}) "
                                     f"has {total / GB:.1f} GB",
                                     "run it on GPUs with more memory, or re-plan with `planner search` for this GPU")
        return
    per_core = int(lab_limit(cluster.device, "ranks_per_core"))
    limit = per_core * host.cores
    if world > limit:
        raise ExecutionError("plan.json dp/tp/pp", f"{world} ranks on {host.cores} core(s): more than "
                             f"{per_core} ranks per core, the most measured to train here",
                             f"re-plan with at most --gpus {limit}xcpu (or `planner run --ignore-host-checks`)")
    if host.mem_available_bytes is None:
        return
    per_stage = [m.total for m in est.stage_memory]
    total = sum(per_stage) * plan.dp * plan.tp
    fraction = lab_limit(cluster.device, "host_memory_fraction")
    allowed = host.mem_available_bytes * fraction
    if total > allowed:
        raise ExecutionError("plan.json cluster",
                             f"{world} ranks need {total / GB:.1f} GB predicted ({max(per_stage) / GB:.2f} GB "
                             f"per rank at most), more than {fraction:.0%} "
                             f"({allowed / GB:.1f} GB) of this host's "
                             f"{host.mem_available_bytes / GB:.1f} GB available (MemAvailable)",
                             "re-plan with a smaller --scale or fewer --gpus, free memory (or `planner run "
                             "--ignore-host-checks`)")


# --- all of it ---------------------------------------------------------------------------------

def check(run_dir: str | Path, plan: Plan, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
          doc: dict[str, Any], *, ignore_host: bool = False, host: Host | None = None) -> dict[str, Any] | None:
    """Every check above, in order; raises the first refusal. Returns the DeepSpeed config
    to write when ds_config.json is missing (the caller writes it once the run may start)."""
    from planner import dsconfig
    from planner.rundir import read_json
    check_plan(plan, model, cluster, train)
    expected = dsconfig.ds_config(plan, model, train, cluster)
    path = Path(run_dir) / "ds_config.json"
    missing = not path.exists()
    if not missing:
        check_config(read_json(path, "ds_config.json"), plan, model, expected)
    if not ignore_host:
        check_host(plan, model, cluster, train, host or probe_host(cluster.device.kind != "cpu"), doc)
    return expected if missing else None


def check_run(run_dir: str | Path, *, ignore_host: bool = False) -> None:
    """`check` for a run directory as written (used by `planner verify` before anything starts)."""
    from planner.rundir import load_run
    plan, model, cluster, train, doc = load_run(run_dir)
    check(run_dir, plan, model, cluster, train, doc, ignore_host=ignore_host)


# --- 4. the trainer's inputs (issue 10) ----------------------------------------------------------

def check_trainer(run_dir: str | Path, plan: Plan, model: ModelSpec, train: TrainSpec, opts: Any) -> None:
    """The trainer's options (planner.runtime.train.options.TrainerOptions, `planner run`'s flags)
    that the ranks would otherwise trip over after start-up: the
    schedule's numbers, the corpus and tokenizer (planner.data.batching.check_data: corpus at
    least one global batch, tokenizer present and its vocabulary within the model's), the
    metrics port (a bind test on the address rank 0 will serve), and the Hugging Face
    directories. Raises the first problem; touches nothing."""
    import math

    from planner.dsconfig import LR_SCHEDULES
    data, tokenizer, lr, lr_schedule = opts.data, opts.tokenizer, opts.lr, opts.lr_schedule
    init_hf, save_hf, metrics_port, data_workers = opts.init_hf, opts.save_hf, opts.metrics_port, opts.data_workers
    eval_every, eval_batches, checkpoint_every = opts.eval_every, opts.eval_batches, opts.checkpoint_every
    lr_warmup_steps = opts.lr_warmup_steps
    for name, value, low in (("--eval-every", eval_every, 0), ("--eval-batches", eval_batches, 1),
                             ("--checkpoint-every", checkpoint_every, 0), ("--lr-warmup-steps", lr_warmup_steps, 0),
                             ("--metrics-port", metrics_port, 0),
                             ("--data-workers", 0 if data_workers is None else data_workers, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise SpecError(name, f"must be an integer >= {low}, got {value!r}", f"give {name} {max(low, 1)} or more")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise SpecError("--lr", f"must be a positive number, got {lr!r}", "e.g. --lr 3e-4")
    if lr_schedule is not None and lr_schedule not in LR_SCHEDULES:
        raise SpecError("--lr-schedule", f"unknown schedule {lr_schedule!r}", f"use one of {', '.join(LR_SCHEDULES)}")
    if tokenizer and not data:
        raise SpecError("--tokenizer", "given without --data", "add --data CORPUS (a .txt or .jsonl of text)")
    if data:
        _check_data(data, tokenizer, opts.seed, model, train, plan)
    if init_hf:
        p = Path(init_hf)
        if not p.is_dir():
            raise SpecError("--init-hf", f"{p} is not a directory", "give a Hugging Face checkpoint directory "
                            "(config.json and *.safetensors)")
        from planner.hf import weights
        check = getattr(weights, "check_hf_checkpoint", None)
        if check is not None:  # config against the model, every tensor's presence and shape (headers only)
            check(p, model, "--init-hf")
    if save_hf:
        p = Path(save_hf)
        if p.exists() and not p.is_dir():
            raise SpecError("--save-hf", f"{p} exists and is not a directory", "give a directory path")
        parent = p.resolve().parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            raise SpecError("--save-hf", f"cannot write under {parent}", "give a writable directory")
    if metrics_port:
        from planner.runtime.observe.prom import port_problem
        problem = port_problem(metrics_port, opts.metrics_host)
        if problem:
            raise ExecutionError("--metrics-port", problem, "pick a free port (e.g. --metrics-port 9400) or stop "
                                 "what listens there")


def _check_data(data: str, tokenizer: str, seed: int, model: ModelSpec, train: TrainSpec, plan: Plan) -> None:
    """The corpus as the ranks will read it (data.check_data)."""
    from planner.data import batching as datamod
    from planner.data.corpus import data_spec
    # a Megatron indexed dataset is named by its prefix (PREFIX.bin + PREFIX.idx)
    if not Path(data).exists() and not Path(f"{data}.idx").exists():
        raise SpecError("--data", f"{data} does not exist", "give a corpus file (.txt, .jsonl, .npy, .bin/.idx "
                        "or the PREFIX of PREFIX.bin/.idx)")
    if tokenizer and not Path(tokenizer).is_dir():
        raise SpecError("--tokenizer", f"{tokenizer} is not a directory", "give a local Hugging Face tokenizer "
                        "directory (tokenizer.json)")
    spec = data_spec(str(data), str(tokenizer or ""), seed, train, model)
    datamod.check_data(spec, datamod.Layout(plan.micro_batch, plan.grad_accum, plan.dp))
