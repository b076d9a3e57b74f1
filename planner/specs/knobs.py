"""One place per knob: what each Plan field is outside the Plan.

For every field of planner.specs.plan.Plan: the ladder technique that sets it (planner/ladder),
the `planner estimate` option that gives it (generated from this table by planner/cli/plan_options.py,
with this help text and these choices), and the DeepSpeed config key it becomes
(planner/dsconfig.py writes it; the report shows it). Its type is the field's; trials.csv reads
and writes it by that type (planner/search/trials.py). tests/unit/test_knobs.py holds this table
to the Plan's fields, so a new field comes with its row here.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.specs.plan import CP_KINDS, OFFLOAD, RECOMPUTE

TECHNIQUES = ("precision", "overlap", "batching", "zero", "recompute", "layout")
"""The ladder's techniques in the article's order: mixed precision, communication overlap and
buckets, dynamic batching, ZeRO, activation checkpointing, the parallel layout."""


@dataclass(frozen=True, slots=True)
class Knob:
    technique: str | None
    """The ladder technique that sets the field; None: derived (no technique decides it)."""
    flag: str | None = None
    """`planner estimate`'s option for it; None: the command derives it from other inputs."""
    help: str = ""
    choices: tuple[str, ...] | None = None
    ds_key: str | None = None
    """The DeepSpeed config key it becomes (dotted path in ds_config.json); None: not a DeepSpeed key."""
    label: str = ""
    """Short label of the DeepSpeed setting (the report's knob list)."""
    note: str = ""
    """What the DeepSpeed setting holds, in a few words (the report's knob list)."""
    always: bool = False
    """The report lists the setting even at its default."""


KNOBS: dict[str, Knob] = {
    "dp": Knob("layout", None, "data-parallel degree: the devices / (tp x pp x cp)"),
    "tp": Knob("layout", "--tp", "Tensor-parallel degree."),
    "pp": Knob("layout", "--pp", "Pipeline-parallel degree."),
    "zero": Knob("zero", "--zero", "ZeRO stage 0-3 (0-1 with --pp > 1).", ds_key="zero_optimization.stage",
                 label="zero", always=True),
    "micro_batch": Knob("recompute", "--micro-batch", "Sequences per micro-batch.",
                        ds_key="train_micro_batch_size_per_gpu", label="micro", always=True),
    "grad_accum": Knob(None, None, "the global batch / (micro-batch x dp)", ds_key="gradient_accumulation_steps",
                       label="accum", always=True),
    "stage_layers": Knob("layout", "--stage-layers", "Blocks per stage (default: even split)."),
    "recompute": Knob("recompute", "--recompute", "", choices=RECOMPUTE),
    "recompute_layers": Knob("recompute", "--recompute-layers",
                             "With --recompute full: checkpointed blocks per stage (default: all)."),
    "sequence_parallel": Knob("layout", "--sequence-parallel", "Megatron sequence parallelism (needs --tp > 1)."),
    "ep": Knob("layout", "--ep", "Expert-parallel size (MoE models; divides the experts and the data-parallel "
               "degree)."),
    "cp": Knob("layout", "--cp", "Context-parallel degree: ranks splitting each sequence (docs/long-context.md)."),
    "cp_kind": Knob("layout", "--cp-kind", "ulysses (DeepSpeed-Ulysses all-to-all) or ring (Megatron-Core context "
                    "parallelism).", choices=CP_KINDS),
    "schedule": Knob("layout", None, "interleaved when --interleave > 1, else 1f1b"),
    "interleave": Knob("layout", "--interleave", "Virtual chunks per stage (> 1: interleaved 1F1B)."),
    "precision": Knob("precision", None, "the training precision (--precision)"),
    "overlap_comm": Knob("overlap", None, "", ds_key="zero_optimization.overlap_comm", label="overlap", always=True),
    "bucket_elements": Knob("overlap", "--bucket-elements", "reduce/allgather bucket size in elements (ZeRO-3: also "
                            "sub_group_size).", ds_key="zero_optimization.reduce_bucket_size", label="bucket",
                            always=True),
    "prefetch_elements": Knob("zero", "--prefetch-elements", "ZeRO-3 stage3_prefetch_bucket_size in elements; 0 = "
                              "--bucket-elements.", ds_key="zero_optimization.stage3_prefetch_bucket_size",
                              label="prefetch"),
    "live_elements": Knob("zero", "--live-elements", "ZeRO-3 stage3_max_live_parameters (and max_reuse_distance) in "
                          "elements; 0 = --bucket-elements.", ds_key="zero_optimization.stage3_max_live_parameters",
                          label="live"),
    "persistence_elements": Knob("zero", "--persistence-elements", "ZeRO-3 stage3_param_persistence_threshold in "
                                 "elements; 0 = 10 x hidden.",
                                 ds_key="zero_optimization.stage3_param_persistence_threshold", label="persist"),
    "offload_optimizer": Knob("zero", "--offload-optimizer", "ZeRO-Offload / ZeRO-Infinity: fp32 master weights, "
                              "Adam moments and gradients on the host (cpu, ZeRO 1-3) or NVMe (nvme, ZeRO-3); Adam "
                              "runs on the CPU.", choices=OFFLOAD,
                              ds_key="zero_optimization.offload_optimizer.device", label="off-opt",
                              note="fp32 master weights, Adam moments, gradients; Adam on the CPU"),
    "offload_params": Knob("zero", "--offload-params", "ZeRO-Infinity (ZeRO-3): the 16-bit weight partition on the "
                           "host (cpu) or NVMe (nvme).", choices=OFFLOAD,
                           ds_key="zero_optimization.offload_param.device", label="off-par", note="16-bit weights"),
    "hpz": Knob("zero", "--hpz", "ZeRO++ hpZ (ZeRO-3): secondary weight partition over N ranks inside a node; 1 = off.",
                ds_key="zero_optimization.zero_hpz_partition_size", label="hpZ", note="ZeRO++ secondary partition"),
    "quantized_weights": Knob("zero", "--qwz", "ZeRO++ qwZ (ZeRO-3): gather weights in int8.",
                              ds_key="zero_optimization.zero_quantized_weights", label="qwZ",
                              note="ZeRO++ int8 weight gathers"),
    "quantized_gradients": Knob("zero", "--qgz", "ZeRO++ qgZ (ZeRO-3): reduce gradients hierarchically in int4.",
                                ds_key="zero_optimization.zero_quantized_gradients", label="qgZ",
                                note="ZeRO++ int4 gradient reduce"),
    "mics_shard": Knob("zero", "--mics-shard", "MiCS (ZeRO-3): shard model states over groups of N ranks, replicated "
                       "across groups; 0 = off.", ds_key="zero_optimization.mics_shard_size", label="MiCS"),
    "runtime": Knob(None, None, "the runtime (--runtime)"),
}


def technique_fields() -> dict[str, tuple[str, ...]]:
    """Plan fields each ladder technique sets (batching sets none: it is the data's)."""
    return {t: tuple(name for name, k in KNOBS.items() if k.technique == t) for t in TECHNIQUES}


__all__ = ["KNOBS", "Knob", "TECHNIQUES", "technique_fields"]
