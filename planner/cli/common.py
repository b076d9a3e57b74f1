"""Options shared by several commands, and turning them into specs."""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console

from planner.errors import SpecError
from planner.specs.compare import comparison_rows
from planner.specs.hardware import ClusterSpec, load_profile, parse_cluster
from planner.specs.model import ModelSpec
from planner.specs.presets import preset, scale
from planner.specs.train import ATTENTION, ATTENTION_BACKENDS, TrainSpec

SCALE_CHOICES = ["full", "tiny", "small"]


def model_options(f: Callable) -> Callable:
    f = click.option("--scale", type=click.Choice(SCALE_CHOICES), default=None,
                     help="Shrink the model (same shape family) to run on a CPU machine.")(f)
    f = click.option("--model", "model_arg", required=True, metavar="NAME|CONFIG.JSON",
                     help="A preset (glm-10b, glm-130b, chatglm-6b, chatglm2-6b, chatglm3-6b, glm-4-9b) "
                          "or a Hugging Face config.json.")(f)
    return f


VARIANT_HELP = ("A model-variant what-if (repeatable; docs/variants.md): linear-attention, ffn-sparsity=F "
                "(0 < F < 1, structured pruning of the FFN), share-layers=K (K consecutive blocks share "
                "parameters; K divides the layers), sparse-gemm-efficiency=E (0 < E <= 1, FFN GEMM time / E). "
                "The base model is shown next to the variant.")


def variant_option(f: Callable) -> Callable:
    """--variant, repeatable (planner search, estimate, serve)."""
    return click.option("--variant", "variants", multiple=True, metavar="VARIANT", help=VARIANT_HELP)(f)


def _number(text: str, kind: type, flag: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise SpecError("--variant", f"{flag}={text!r} is not a {'whole ' if kind is int else ''}number",
                        f"e.g. --variant {flag}={'2' if kind is int else '0.5'}") from None


def apply_variants(model: ModelSpec, variants: tuple[str, ...] | list[str]) -> ModelSpec:
    """The model with the --variant what-ifs applied (ModelSpec.attention_kind, ffn_sparsity,
    share_layers, sparse_gemm_efficiency), its name suffixed with the variant label. Bad or
    inapplicable variants raise SpecError (one line, exit 2)."""
    if not variants:
        return model
    fields: dict[str, Any] = {}
    for raw in variants:
        key, _, value = raw.strip().lower().partition("=")
        if key in fields or (key == "linear-attention" and "attention_kind" in fields):
            raise SpecError("--variant", f"{key} given twice", "give each variant once")
        if key == "linear-attention":
            if value:
                raise SpecError("--variant", f"linear-attention takes no value, got {raw!r}", "--variant linear-attention")
            fields["attention_kind"] = "linear"
        elif key == "ffn-sparsity":
            f = _number(value, float, key)
            if not 0.0 < f < 1.0:
                raise SpecError("--variant ffn-sparsity", f"must be in (0, 1), got {value}",
                                "e.g. --variant ffn-sparsity=0.5 (half the FFN columns pruned)")
            fields["ffn_sparsity"] = f
        elif key == "share-layers":
            fields["share_layers"] = _number(value, int, key)
        elif key == "sparse-gemm-efficiency":
            fields["sparse_gemm_efficiency"] = _number(value, float, key)
        else:
            raise SpecError("--variant", f"unknown variant {raw!r}",
                            "use linear-attention, ffn-sparsity=F, share-layers=K or sparse-gemm-efficiency=E")
    if "sparse_gemm_efficiency" in fields and "ffn_sparsity" not in fields:
        raise SpecError("--variant sparse-gemm-efficiency", "applies to a pruned FFN only",
                        "add --variant ffn-sparsity=F")
    spec = dataclasses.replace(model, **fields)
    return dataclasses.replace(spec, name=f"{model.name}+{spec.variant_label}")


def cluster_options(f: Callable) -> Callable:
    f = click.option("--memory-headroom", type=float, default=None, metavar="GB",
                     help="GB per GPU left free for CUDA context, NCCL communicator buffers and the allocator's "
                          "reserve, counted in every plan's peak (default: the profile's memory_overhead_gb); "
                          "plans within 2% of the GPU's memory are flagged.")(f)
    f = click.option("--checkpoint-gbps", type=float, default=None, metavar="GB/S",
                     help="Checkpoint write bandwidth per node, for the checkpoint interval on --spot "
                          "(default: the profile's host block).")(f)
    f = click.option("--nvme-gb", type=float, default=None, metavar="GB",
                     help="NVMe capacity per node for ZeRO-Infinity's swap files; a plan that offloads more is "
                          "infeasible (default: the profile's host block).")(f)
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
    f = click.option("--attention-backend", type=click.Choice([b for b in ATTENTION_BACKENDS if b]), default=None,
                     help="The flash kernel family the runtime is configured to run, where its environment "
                          "overrides the runtime's preference (e.g. fa2 under Transformer Engine with "
                          "NVTE_FUSED_ATTN=0); default: the runtime's own choice.")(f)
    f = click.option("--attention", type=click.Choice(list(ATTENTION)), default="flash", show_default=True,
                     help="Attention kernel the run uses: flash (torch SDPA, no s x s scores kept, backward "
                          "recomputes them) or eager (softmax stored; selective recompute pays off).")(f)
    f = click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32", "fp8"]), default=None,
                     help="Training precision (default bf16, fp16 where bf16 is unsupported; fp8: Transformer "
                          "Engine, --runtime megatron-core or fsdp on an FP8 GPU, where it is also searched beside "
                          "bf16).")(f)
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
                 nvme_gbps: float | None = None, memory_headroom: float | None = None,
                 nvme_gb: float | None = None, checkpoint_gbps: float | None = None) -> ClusterSpec:
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
    if nvme_gb is not None and not (0 < nvme_gb < 1e7):
        raise SpecError("--nvme-gb", f"must be GB in (0, 1e7), got {nvme_gb}",
                        "give the NVMe capacity per node in GB, e.g. 15360 (no NVMe: --nvme-gbps 0)")
    if checkpoint_gbps is not None and not (0 < checkpoint_gbps < 1e5):
        raise SpecError("--checkpoint-gbps", f"must be GB/s in (0, 1e5), got {checkpoint_gbps}",
                        "give the checkpoint write bandwidth per node in GB/s, e.g. 5")
    if memory_headroom is not None and not (0 <= memory_headroom < float("inf")):
        raise SpecError("--memory-headroom", f"must be GB >= 0, got {memory_headroom}",
                        "give the GB each GPU keeps free, e.g. 2")
    prof = load_profile(profile_path) if profile_path else None
    return parse_cluster(gpus, prof, inter_gbps=inter_gbps, inter_latency_us=inter_latency_us, intra_gbps=intra_gbps,
                         cpu_mem_gb=cpu_mem_gb, nvme_gbps=nvme_gbps, memory_headroom=memory_headroom,
                         nvme_gb=nvme_gb, checkpoint_gbps=checkpoint_gbps)


def load_train(model: ModelSpec, cluster: ClusterSpec, global_batch: int | None, seq_len: int | None,
               precision: str | None, attention: str = "flash", attention_backend: str | None = None) -> TrainSpec:
    cpu = cluster.device.kind == "cpu"
    if global_batch is None:
        global_batch = 8 if cpu else 512
    if seq_len is None:
        seq_len = min(128 if cpu else 2048, model.max_seq)
    if precision is None:
        precision = "bf16" if cluster.device.supports("bf16") else "fp16"
    if precision == "fp8" and not cluster.device.supports("fp8"):
        raise SpecError("--precision", f"{cluster.device.name} has no FP8 tensor cores",
                        "use bf16, or an FP8 GPU (H100, H200, L40S, B200)")
    if seq_len > model.max_seq:
        raise SpecError("--seq-len", f"{seq_len} exceeds {model.name}'s maximum sequence {model.max_seq}",
                        f"use --seq-len {model.max_seq} or less")
    return TrainSpec(global_batch=global_batch, seq_len=seq_len, precision=precision, attention=attention,
                     attention_backend=attention_backend or "")


def load_inputs(kw: dict[str, Any]) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """Pop the shared options from a command's kwargs and build the three specs."""
    model = apply_variants(load_model(kw.pop("model_arg"), kw.pop("scale")), kw.pop("variants", ()))
    cluster = load_cluster(kw.pop("gpus"), kw.pop("profile_path"), kw.pop("inter_gbps"),
                           kw.pop("inter_latency_us"), kw.pop("intra_gbps"), cpu_mem_gb=kw.pop("cpu_mem_gb"),
                           nvme_gbps=kw.pop("nvme_gbps"), memory_headroom=kw.pop("memory_headroom"),
                           nvme_gb=kw.pop("nvme_gb"), checkpoint_gbps=kw.pop("checkpoint_gbps"))
    train = load_train(model, cluster, kw.pop("global_batch"), kw.pop("seq_len"), kw.pop("precision"),
                       kw.pop("attention"), kw.pop("attention_backend", None))
    return model, cluster, train


def common_inputs(f: Callable) -> Callable:
    """--model/--scale, --gpus/--profile/network/host/--memory-headroom, --global-batch/--seq-len/
    --precision/--attention."""
    return model_options(cluster_options(train_options(f)))




# --- --variant: the variant next to its base (rows: planner/specs/compare.py) -------------------
def serving_comparison(base_model: ModelSpec, base: Any, model: ModelSpec, est: Any,
                       dep: Any) -> list[tuple[str, str, str, str]]:
    """(figure, base, variant, variant / base) rows of two serving estimates of one deployment."""
    from planner.serve.memory import kv_bytes_per_token, state_bytes_per_sequence

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1e3
    return comparison_rows([
        ("parameters", base_model.params, model.params, ",.0f"),
        ("weights GB per GPU", base.memory_gb["weights"], est.memory_gb["weights"], ".3f"),
        ("KV bytes per token", kv_bytes_per_token(base_model, dep), kv_bytes_per_token(model, dep), ",.0f"),
        ("state bytes per sequence", state_bytes_per_sequence(base_model, dep),
         state_bytes_per_sequence(model, dep), ",.0f"),
        ("max batch (memory)", base.batch_limit, est.batch_limit, "d"),
        ("TTFT ms (alone)", ms(base.ttft_alone_s), ms(est.ttft_alone_s), ",.2f"),
        ("TPOT ms (alone)", ms(base.tpot_alone_s), ms(est.tpot_alone_s), ",.3f"),
        ("TTFT ms (at rate)", ms(base.ttft_s), ms(est.ttft_s), ",.2f"),
        ("TPOT ms (at rate)", ms(base.tpot_s), ms(est.tpot_s), ",.3f"),
        ("max QPS", base.max_qps, est.max_qps, ",.2f")])


def comparison_table(title: str, rows: list[tuple[str, str, str, str]], base_name: str, name: str) -> Any:
    from rich.table import Table
    t = Table(title=title)
    t.add_column("figure")
    for col in (f"base {base_name}", f"variant {name}", "variant/base"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*r)
    return t


# --- the bill: --tokens, prices, --spot ----------------------------------------------------------
def bill_options(f: Callable) -> Callable:
    """--tokens, --gpu-hour-price, --spot-price, --spot, --preemption-rate, --restart-min (docs/cost.md)."""
    f = click.option("--restart-min", type=float, default=10.0, show_default=True, metavar="MIN",
                     help="With --spot: minutes from a preemption to training again (new node, launcher, NCCL), "
                          "before the checkpoint is read back (an assumption: measure yours).")(f)
    f = click.option("--preemption-rate", type=float, default=None, metavar="PER_NODE_HOUR",
                     help="With --spot: preemptions per node-hour of your spot pool (required: no published rate "
                          "is on file).")(f)
    f = click.option("--spot", is_flag=True,
                     help="Also cost the run on spot capacity: Young/Daly checkpoint interval from the checkpoint "
                          "write time, lost work and restarts per preemption.")(f)
    f = click.option("--spot-price", type=float, default=None, metavar="USD",
                     help="Spot USD per GPU-hour (default: profiles/prices.json, with its source).")(f)
    f = click.option("--gpu-hour-price", type=float, default=None, metavar="USD",
                     help="On-demand USD per GPU-hour (default: profiles/prices.json, with its source).")(f)
    f = click.option("--tokens", type=float, default=None, metavar="N",
                     help="Tokens to train, e.g. 4e11 (default: the model's published training run, else 100B); "
                          "every plan prints the days and cost to train them.")(f)
    return f


def load_bill(kw: dict[str, Any], model: ModelSpec, cluster: ClusterSpec) -> Any:
    """Pop the bill options and check them (one line, exit 2 on bad input): a BillSpec."""
    from planner.cost import bill
    tokens, od, sp = kw.pop("tokens"), kw.pop("gpu_hour_price"), kw.pop("spot_price")
    spot, rate, restart = kw.pop("spot"), kw.pop("preemption_rate"), kw.pop("restart_min")
    if tokens is None:
        tokens, note = bill.default_tokens(model.name)
    else:
        tokens, note = bill.check_tokens(tokens), "--tokens"
    device = cluster.device.name
    price = bill.Price(usd_per_gpu_hour=bill.check_price(od), kind="given") if od is not None \
        else bill.price_for(device, "on_demand")
    spot_price = None
    if spot:
        if rate is None:
            raise SpecError("--preemption-rate", "--spot needs the preemption rate of your spot pool",
                            "add e.g. --preemption-rate 0.05 (preemptions per node-hour)")
        rate = bill.check_rate(rate)
        restart = bill.check_restart(restart)
        if not cluster.host.checkpoint_gbps:
            raise SpecError("--checkpoint-gbps", f"the {device} profile has no checkpoint write bandwidth",
                            "pass --checkpoint-gbps (GB/s per node to the checkpoint store), e.g. 5")
        spot_price = bill.Price(usd_per_gpu_hour=bill.check_price(sp, "--spot-price"), kind="given") \
            if sp is not None else bill.price_for(device, "spot")
        if spot_price is not None and spot_price.kind == "given":
            spot_price = dataclasses.replace(spot_price, source="--spot-price")
    else:
        for flag, v in (("--preemption-rate", rate), ("--spot-price", sp)):
            if v is not None:
                raise SpecError(flag, "applies to spot capacity only", "add --spot")
    return bill.BillSpec(tokens=tokens, tokens_note=note, price=price, spot=spot, spot_price=spot_price,
                         preemption_rate=rate or 0.0, restart_min=restart)


# --- what search, estimate and serve share: console, the command line, runtimes -------------------
def console(err: bool = False) -> Console:
    console = Console(stderr=err, highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(stderr=err, highlight=False, soft_wrap=False, width=160)
    return console


def command_line(ctx: click.Context) -> str:
    """The command as a user would retype it (options given explicitly, in order)."""
    parts = ["planner", ctx.info_name or "search"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if ctx.get_parameter_source(param.name) != click.core.ParameterSource.COMMANDLINE:
            continue
        flag = param.opts[0]
        if isinstance(param, click.Option) and param.is_flag:
            parts.append(flag)
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def runtimes_for(name: str, megatron_features: bool) -> list[str]:
    """The runtimes to search, the one whose run directory is written first; one line naming
    --runtime for an unknown name (planner.cost.runtime.get_runtime)."""
    from planner.cost.runtime import NAMES, get_runtime
    if megatron_features:
        if name not in ("deepspeed", "megatron-core"):
            raise SpecError("--megatron-features", f"is --runtime megatron-core, not {name}", "give one of the two")
        return ["megatron-core"]
    if name == "all":
        return list(NAMES)
    get_runtime(name)
    return [name]


def fp8_offered(train, runtimes: list[str]) -> None:
    """--precision fp8 needs a runtime with Transformer Engine: one line naming --runtime."""
    from planner.cost.runtime import get_runtime
    lacking = [rt for rt in runtimes if train.precision not in get_runtime(rt).precisions]
    if lacking and len(lacking) == len(runtimes):
        raise SpecError("--precision", f"{train.precision} is not offered on runtime {lacking[0]} (no Transformer "
                        "Engine)", "use --runtime megatron-core or fsdp, or --precision bf16")


def runtime_comparison(results: dict) -> list[str]:
    """Which runtime's best plan is fastest for this job and by how much (--runtime all)."""
    ok = {rt: r.best.estimate.tokens_per_s for rt, r in results.items() if r is not None}
    lines = [f"runtime {rt}: " + (f"{results[rt].best.estimate.tokens_per_s:,.0f} tokens/s with "
                                  f"{results[rt].best.plan.describe()}" if rt in ok else "no plan fits")
             for rt in results]
    if ok:
        win = max(ok, key=ok.get)
        others = ", ".join(f"{ok[win] / v:.2f}x {rt}" for rt, v in ok.items() if rt != win)
        lines.append(f"fastest runtime: {win}" + (f" ({others} tokens/s)" if others else "")
                     + ("" if win == "deepspeed" else "; `planner run` executes deepspeed only"))
    return lines
