"""Every published run of shared reference/ as one kind of row: its source, runtime, GPU, the
plans the source allows (all of them where it leaves micro-batch or interleaving unstated: the
authors tuned them, so the fastest that fits is the prediction) and its measured step time.

Sources (one key each, the unit of leave-one-source-out):
- T1: calibration.md, Megatron-LM Table 1 (Narayanan et al. 2021), A100-80GB, megatron-core;
- DS-A, DS-A13, DS-B, DS-C, DS-D, DS-E: deepspeed-at-scale.md sections A-E (deepspeed), as
  encoded in profiles/reference/deepspeed-rows.json;
- S1, S5, S6, S7 (megatron-core) and S8 (fsdp): modern-runs.md, as encoded in
  benchmarks/modern_runs_rows.json.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from modern_runs import LLAMA

from planner.cost import layer_costs
from planner.cost.compute import model_flops_per_sequence
from planner.search.checkpoint import StageModel
from planner.specs import ModelSpec, Plan, TrainSpec, find_device, parse_cluster
from planner.specs.cluster import ClusterSpec

HERE = Path(__file__).resolve().parent

# params(B), heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
"""calibration.md, Megatron-LM weak scaling (Narayanan et al., SC21, arXiv 2104.04473, Table 1)."""

SOURCE_NAMES = {
    "T1": "Megatron-LM Table 1 (calibration.md; Narayanan et al. 2021), A100-80GB",
    "DS-A": "BigScience tr11 prequel, Megatron-DeepSpeed on Jean Zay A100 (deepspeed-at-scale.md A)",
    "DS-A13": "Megatron-DeepSpeed GPT-3 13B, 128 V100 (deepspeed-at-scale.md A)",
    "DS-B": "DeepSpeed ZeRO-3 on Azure NDm A100 v4 (deepspeed-at-scale.md B)",
    "DS-C": "DeepSpeed ZeRO-3 vs ZeRO++ tutorial log, 64 V100 (deepspeed-at-scale.md C)",
    "DS-D": "DeepSpeed ZeRO-Offload tutorial log, 1 V100 (deepspeed-at-scale.md D)",
    "DS-E": "ZeRO paper Fig. 4, ZeRO-2 on 128 V100 (deepspeed-at-scale.md E)",
    "S1": "Megatron-LM README GPT weak scaling, H100 (modern-runs.md S1)",
    "S5": "NeMo 24.07 pre-training, DGX-H100 FP8 (modern-runs.md S5)",
    "S6": "Megatron-Bridge Llama 3, DGX-H100 / DGX-B200 FP8 (modern-runs.md S6)",
    "S7": "NeMo long-sequence / context-parallel, FP8 (modern-runs.md S7)",
    "S8": "MosaicML llm-foundry MPT, PyTorch FSDP on A100 (modern-runs.md S8)",
}
DS_SOURCE_KEYS = {"A-bloom": "DS-A", "A-13b": "DS-A13", "B-azure": "DS-B", "C-zeropp": "DS-C", "D-offload": "DS-D",
                  "E-zero": "DS-E"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    plan: Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class RefRow:
    id: str
    source: str
    """Key of SOURCE_NAMES: the unit of leave-one-source-out."""
    runtime: str
    gpu: str
    measured_s: float
    """Published step time (or derived from the published throughput as the source's table says)."""
    cases: tuple[Case, ...] = ()
    """Plans the source allows; the prediction is the fastest that fits."""
    unsupported: str = ""
    """What the cost model cannot represent yet (the row is listed, never scored)."""
    note: str = ""


def fewest_recomputed(case: Case) -> Case:
    """A full-recompute case whose source does not state the recompute (S1, S5-S7: "recipe
    default"), with the fewest checkpointed blocks per stage that fit (Megatron's
    --recompute-num-layers; the planner's own checkpoint solver, planner/search/checkpoint.py):
    what a user of the planner would run. Unchanged when even full recompute does not fit."""
    plan = case.plan
    sm = StageModel(case.cluster, plan, layer_costs(case.model, case.cluster, case.train, plan))
    ks = [sm.fewest_checkpointed(i, n, True) for i, n in enumerate(plan.layers_per_stage(case.model.layers))]
    if None in ks:
        return case
    return dataclasses.replace(case, plan=dataclasses.replace(plan, recompute_layers=tuple(ks)))


def megatron_gpt(name: str, hidden: int, layers: int, heads: int, vocab: int, seq: int) -> ModelSpec:
    """Megatron-LM's GPT: learned positions, tied embeddings, GELU 4h FFN, pre-LayerNorm with
    biases, dropout 0.1 (Megatron-LM's defaults)."""
    return ModelSpec(name=name, model_type="gpt2", hidden=hidden, layers=layers, heads=heads, ffn_hidden=4 * hidden,
                     activation="gelu", vocab=vocab, max_seq=seq, norm="layernorm", norm_position="pre",
                     position="learned", tied_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1)


def _megatron_cases(model: ModelSpec, cluster: ClusterSpec, seq: int, gbs: int, tp: int, pp: int, dp: int,
                    recompute: tuple[str, ...], mbs: tuple[int, ...] = (1, 2, 4, 8),
                    chunks: tuple[int, ...] = (1, 2, 3, 4, 6, 8), zero: int = 1, sp: bool | None = None,
                    tuned_recompute: bool = True, attention: str = "flash") -> tuple:
    train = TrainSpec(global_batch=gbs, seq_len=seq, precision="bf16", attention=attention)
    out = []
    for mb in mbs:
        if gbs % (mb * dp):
            continue
        m = gbs // (mb * dp)
        for v in ((1,) if pp == 1 else chunks):
            if v > 1 and (model.layers % (pp * v) or m % pp):
                continue
            for rc in recompute:
                plan = Plan(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, grad_accum=m, recompute=rc,
                            schedule="interleaved" if v > 1 else "1f1b", interleave=v, precision="bf16",
                            sequence_parallel=(tp > 1) if sp is None else (sp and tp > 1), runtime="megatron-core")
                case = Case(model=model, cluster=cluster, train=train, plan=plan)
                out.append(fewest_recomputed(case) if rc == "full" and tuned_recompute else case)
    return tuple(out)


def every_chunking(layers: int, pp: int) -> tuple[int, ...]:
    """Every interleaving Megatron-Core can run for `layers` over `pp` stages: v chunks per stage
    with the layers split evenly over pp x v model chunks (--num-layers-per-virtual-pipeline-stage
    must divide the layers per stage). S1's README states no interleaving: the fastest of these that
    fits is the prediction, as for its unstated micro-batch (92 layers over 4 stages interleave
    only in 23 chunks of one layer, 112 over 16 in 7)."""
    per = layers // pp
    return tuple(v for v in range(1, per + 1) if per % v == 0)


def table1_rows() -> list[RefRow]:
    """Interleaved 1F1B with scatter/gather, full recompute, no sequence parallelism (2021, before
    Korthikanti et al. 2022), no distributed optimizer; micro-batch and chunks not stated. The
    attention core is Megatron-LM's of 2021 (before FlashAttention, Dao et al. 2022): torch.baddbmm
    for Q K^T, the fused scale-mask-softmax over all s x s scores, torch.bmm with V
    (megatron/model/transformer.py ParallelAttention at the paper's v2.x): the plan's eager kernel."""
    out = []
    for params_b, heads, hidden, layers, tp, pp, gpus, batch, tflops in TABLE1:
        model = megatron_gpt(f"gpt-{params_b}B", hidden, layers, heads, 51200, 2048)
        cluster = parse_cluster(f"{gpus // 8}x8xA100-80GB")
        s, h, l, v = 2048, hidden, layers, 51200
        flops = 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))  # eq. 3
        out.append(RefRow(id=f"T1-{params_b}B", source="T1", runtime="megatron-core", gpu="A100-80GB",
                          measured_s=flops / (gpus * tflops * 1e12),
                          cases=_megatron_cases(model, cluster, s, batch, tp, pp, gpus // (tp * pp), ("full",),
                                                chunks=(1, 2, 4), zero=0, sp=False, tuned_recompute=False,
                                                attention="eager"),
                          note=f"{params_b}B TP{tp} PP{pp}"))
    return out


def ds_rows() -> list[RefRow]:
    """deepspeed-at-scale.md A-E through benchmarks/ds_reference.py's encoding; TFLOP/s rows
    become step times with the source's own FLOPs convention."""
    import ds_reference as dr  # noqa: PLC0415 - sibling benchmark module

    keys = {v: DS_SOURCE_KEYS[k] for k, v in json.loads(dr.DATA.read_text())["sources"].items()}
    out = []
    for r in dr.load_rows():
        dev = find_device(json.loads(dr.DATA.read_text())["generations"][r.gen]["profile"])[0]
        measured = r.measured if r.metric == "step_s" else dr.source_flops(r) / (r.world * r.measured * 1e12)
        case = Case(model=r.model, cluster=dr.cluster_for(r, dev), train=r.train, plan=r.plan)
        out.append(RefRow(id=r.id, source=keys[r.source], runtime="deepspeed", gpu=dev.name, measured_s=measured,
                          cases=(case,), note=r.note))
    return out


def _mpt(name: str, seq: int) -> ModelSpec:
    """MPT (modern-runs.md S8): MHA, GELU 4h FFN, no biases, vocab 50,368, tied embeddings, a
    learned position embedding of max_seq_len rows, LayerNorm, no dropout."""
    h, a, l = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
               "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
               "70b": (8192, 64, 80)}[name]
    return ModelSpec(name=f"mpt-{name}", model_type="mpt", hidden=h, layers=l, heads=a, ffn_hidden=4 * h,
                     activation="gelu", vocab=50368, max_seq=seq, norm="layernorm", norm_position="pre",
                     position="learned", tied_embeddings=True, qkv_bias=False, linear_bias=False)


def modern_rows() -> list[RefRow]:
    data = json.loads((HERE / "modern_runs_rows.json").read_text())["rows"]
    out = []
    for r in data:
        src, rid = r["source"], r["id"]
        if src == "S1":
            model = megatron_gpt(rid, r["hidden"], r["layers"], r["heads"], r["vocab"], r["seq"])
            cluster = parse_cluster(f"{r['gpus'] // 8}x8xH100-SXM")
            measured = r["gbs"] * model_flops_per_sequence(model, r["seq"]) / (r["gpus"] * r["tflops"] * 1e12)
            out.append(RefRow(id=rid, source=src, runtime="megatron-core", gpu="H100-SXM", measured_s=measured,
                              cases=_megatron_cases(model, cluster, r["seq"], r["gbs"], r["tp"], r["pp"], r["dp"],
                                                    ("none", "full"), chunks=every_chunking(r["layers"], r["pp"])),
                              note=f"{r['layers']}x{r['hidden']} TP{r['tp']} PP{r['pp']}"))
        elif src == "S8":
            model = _mpt(r["model"], r["seq"])
            gpus = r["gpus"]
            cluster = parse_cluster(f"{gpus // 8}x8x{r['gpu']}" if gpus > 8 else f"{gpus}x{r['gpu']}")
            train = TrainSpec(global_batch=r["gbs"], seq_len=r["seq"], precision="bf16", attention="flash",
                              attention_backend=ATTENTION_BACKEND.get((src, r["gpu"]), ("", ""))[0])
            plan = Plan(dp=gpus, zero=3 if r["sharding"] == "FULL_SHARD" else 2, micro_batch=r["mbs"],
                        grad_accum=r["ga"], recompute="full" if r["checkpointing"] else "none", precision="bf16",
                        runtime="fsdp")
            measured = r["gbs"] * r["seq"] / (r["tok_s_gpu"] * gpus)
            out.append(RefRow(id=rid, source=src, runtime="fsdp", gpu=r["gpu"], measured_s=measured,
                              cases=(Case(model=model, cluster=cluster, train=train, plan=plan),),
                              note=f"mpt-{r['model']} seq {r['seq']} {gpus} GPUs mb {r['mbs']}"))
        else:
            out.append(_nvidia_row(r))
    return out


def _arch(r: dict) -> tuple[int, int, int, int, int, str, int] | None:
    """(layers, hidden, heads, KV heads, FFN, activation, vocab) of an S5/S6/S7 model, from the
    table's Arch column (S5) or the Llama shapes (S5/S6 Arch columns); None if unknown."""
    if r.get("model") in LLAMA:
        l, h, a, kv, f, v = LLAMA[r["model"]]
        return l, h, a, kv, f, "swiglu", v
    arch = r.get("arch", "")
    m = re.match(r"(\d+)L h(\d+) (\d+)H(?:\(kv(\d+)\))? (?:MHA )?ffn(\d+) ([\w-]+)", arch)
    if not m:
        return None
    l, h, a, kv, f, act = m.groups()
    v = re.search(r"v(\d+)", arch)
    # GeLU / squared-ReLU are both 2-matrix FFNs: the same GEMMs (costed as gelu)
    return (int(l), int(h), int(a), int(kv or a), int(f), "swiglu" if act == "SwiGLU" else "gelu",
            int(v.group(1)) if v else 50257)


ATTENTION_BACKEND = {
    ("S7", "H100-SXM"): ("fa2", "NeMo-Framework-Launcher launcher_scripts/conf/config.yaml at 01d0773863a5 "
                                "(2024-05-23), the launcher of the table's container nvcr.io/nvidia/nemo:24.03.01."
                                "framework: env_vars NVTE_FUSED_ATTN: 0 ('Disable cudnn FA until we've tested it "
                                "more'), so Transformer Engine runs FlashAttention-2, not cuDNN's fused attention; "
                                "the variable is set from 2024-02-13 (346eaa7b) to 2024-08-20 (48af207b) and gone "
                                "from 2024-08-29 (04b8d098)"),
    **{("S8", gpu): ("triton", "llm-foundry scripts/train/benchmarking/submit_benchmarks.py, the script that produced "
                               "the tables, defaults to --attn_impl triton at every commit up to the tables' last change "
                               "(5f43bf160 2023-05-03 .. 5e85bd62 2024-01-06; flash only from 495218376, 2024-04-22), and "
                               "scripts/train/yamls/pretrain/mpt-*.yaml set attn_config.attn_impl: triton: "
                               "llmfoundry/models/layers/flash_attn_triton.py, the FlashAttention algorithm in Triton "
                               "(copied from HazyResearch flash-attention flash_attn_triton.py at eff9fe6b); timed from "
                               "the A100 profile's 'triton' curve (FlashAttention-2 paper Figure 4, 'FlashAttention "
                               "Triton')") for gpu in ("A100-40GB", "A100-80GB")},
}
"""(source, GPU) -> (flash kernel family, where it is stated): a source whose runtime was configured
to run another kernel than the runtime's preference (TrainSpec.attention_backend). S5 (NeMo 24.07,
published 2024-09-09) straddles the variable's removal and keeps the runtime's preference; S7's
B200 rows (NeMo 25.04) ran without the launcher."""


def _nvidia_row(r: dict) -> RefRow:
    """S5, S6, S7 (Megatron-Core / NeMo, fp8): Llama-style models (RMSNorm, rotary, no biases,
    untied) or GPT-3 / Nemotron (LayerNorm, learned positions... costed with rotary: no
    parameters either way); recompute unstated (recipe defaults): the fastest of none,
    selective and full that fits; MBS stated (S7: assumed 1); VP stated."""
    src, rid = r["source"], r["id"]
    measured = r["gbs"] * r["seq"] / (r["tok_s_gpu"] * r["gpus"]) if r["metric"] == "tokens" else r["derived_step"]
    arch = _arch(r)
    if arch is None:
        return RefRow(id=rid, source=src, runtime="megatron-core", gpu=r["gpu"], measured_s=measured,
                      unsupported="architecture not given", note=r.get("model", ""))
    l, h, a, kv, f, act, v = arch
    llama = act == "swiglu"
    model = ModelSpec(name=r.get("model", rid), model_type="llama" if llama else "gpt", hidden=h, layers=l, heads=a,
                      kv_groups=kv if kv != a else None, ffn_hidden=f, activation=act, vocab=v, max_seq=r["seq"],
                      norm="rmsnorm" if llama else "layernorm", position="rotary", rotary_fraction=1.0,
                      qkv_bias=False, linear_bias=not llama, tied_embeddings=False)
    gpus, tp, pp = r["gpus"], r["tp"], r["pp"]
    cluster = parse_cluster(f"{gpus // 8}x8x{r['gpu']}" if gpus > 8 else f"{gpus}x{r['gpu']}")
    backend = ATTENTION_BACKEND.get((src, r["gpu"]), ("", ""))[0]
    train = TrainSpec(global_batch=r["gbs"], seq_len=r["seq"], precision="fp8", attention="flash",
                      attention_backend=backend)
    # context parallelism (S5-S7 "CP" columns): Megatron-Core's ring attention through Transformer
    # Engine (planner.cost.longctx ring_comm), the cp ranks inside dp: processes = dp x cp x tp x pp
    cp = r.get("cp", 1)
    dp = gpus // (tp * pp * cp)
    mb = r.get("mbs", 1)
    vp = r.get("vp", 1)
    # Megatron-FSDP (S6-1; S6-4's table says FSDP, its recipe DDP: both are tried) shards the
    # model states like ZeRO-3; DDP with the distributed optimizer is ZeRO-1
    sharding = r.get("sharding", "DDP")
    zeros = (3,) if sharding.startswith("Megatron-FSDP") else (3, 1) if sharding.startswith("FSDP") else (1,)
    cases = []
    if r["gbs"] % (mb * dp) == 0:
        for zero, rc in ((z, rc) for z in zeros for rc in ("none", "selective", "full")):
            case = Case(model=model, cluster=cluster, train=train, plan=Plan(
                dp=dp, tp=tp, pp=pp, cp=cp, cp_kind="ring", zero=zero, micro_batch=mb, grad_accum=r["gbs"] // (mb * dp), recompute=rc,
                schedule="interleaved" if vp > 1 else "1f1b", interleave=vp, precision="fp8",
                sequence_parallel=tp > 1, runtime="megatron-core"))
            cases.append(fewest_recomputed(case) if rc == "full" else case)
    return RefRow(id=rid, source=src, runtime="megatron-core", gpu=r["gpu"], measured_s=measured, cases=tuple(cases),
                  unsupported="" if cases else "global batch not divisible", note=r.get("model", ""))


def all_rows() -> list[RefRow]:
    return table1_rows() + ds_rows() + modern_rows()
