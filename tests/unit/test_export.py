"""`planner estimate --write` and `planner export`: each export parsed by its own tool
(transformers' HfArgumentParser and DeepSpeed-config check, accelerate's config loader and
launch validation, torch's torchrun parser); Megatron-DeepSpeed is not installable here, so
its arguments are parsed by a parser transcribed from its source (cited below)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu"]
GLM130 = ["--model", "glm-130b", "--gpus", "96x8xA100-40GB", "--global-batch", "4224", "--seq-len", "2048",
          "--tp", "4", "--pp", "8", "--zero", "1", "--recompute", "full", "--sequence-parallel"]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("zero") / "run"
    assert main(["estimate", *TINY, "--zero", "2", "--write", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def glm_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("glm") / "run"
    assert main(["estimate", *GLM130, "--write", str(d)]) == 0
    return d


# --- estimate --write -----------------------------------------------------------------------
def test_estimate_write_is_a_run_directory_of_the_users_plan(glm_run: Path) -> None:
    from planner.rundir import load_run
    assert {p.name for p in glm_run.iterdir()} == {"plan.json", "estimate.json", "ds_config.json", "launch.sh",
                                                    "hostfile", "trials.csv"}
    plan, model, cluster, train, doc = load_run(glm_run)
    assert (plan.tp, plan.pp, plan.dp, plan.zero, plan.micro_batch, plan.grad_accum) == (4, 8, 24, 1, 1, 176)
    assert plan.sequence_parallel and plan.recompute == "full" and "--write" in doc["inputs"]["command"]
    cfg = json.loads((glm_run / "ds_config.json").read_text())
    assert (cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) == (4224, 176)
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["pipeline"]["stages"] == 8
    est = json.loads((glm_run / "estimate.json").read_text())
    base = est["baseline"]
    # 4224 does not split over 768 devices: the baseline trains 768 x 6 = 4608, a legal plan
    assert (base["plan"]["dp"], base["plan"]["micro_batch"], base["plan"]["grad_accum"], base["global_batch"]) == \
        (768, 1, 6, 4608)
    assert "4,224 does not split over 768" in base["note"] and base["fits"] is False
    assert (glm_run / "hostfile").read_text().count("slots=8") == 96
    assert os.access(glm_run / "launch.sh", os.X_OK)


def test_estimate_write_refuses_what_it_cannot_write(capsys, tmp_path: Path) -> None:
    d = tmp_path / "x"
    rc, _, err = run(capsys, "estimate", *GLM130[:-3], "--recompute", "none", "--write", d)      # does not fit
    assert rc == 2 and "--write: the plan does not fit" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, "estimate", *GLM130, "--interleave", "2", "--write", d)
    assert rc == 2 and "no interleaved schedule" in err and not d.exists()
    (tmp_path / "file").write_text("")
    rc, _, err = run(capsys, "estimate", *TINY, "--write", tmp_path / "file")
    assert rc == 2 and "is not a directory" in err


# --- hf-trainer -----------------------------------------------------------------------------
def test_hf_trainer_parses_with_hf_argument_parser(capsys, zero_run: Path, monkeypatch) -> None:
    from transformers import HfArgumentParser, TrainingArguments
    rc, out, _ = run(capsys, "export", zero_run, "--to", "hf-trainer")
    assert rc == 0, out
    d = zero_run / "export" / "hf-trainer"
    assert {p.name for p in d.iterdir()} == {"ds_config.json", "training_args.json", "train.args", "README.md"}
    monkeypatch.chdir(d)                                  # deepspeed=ds_config.json is relative to the launch dir
    parser = HfArgumentParser(TrainingArguments)
    (from_json,) = parser.parse_json_file("training_args.json")
    (from_args,) = parser.parse_args_into_dataclasses(args=[], args_filename="train.args")
    for a in (from_json, from_args):
        # tiny chatglm3 on 2 CPUs, global batch 8: ZeRO-2, DP 2, micro-batch 1, accumulation 4
        assert (a.per_device_train_batch_size, a.gradient_accumulation_steps) == (1, 4)
        assert a.bf16 and not a.fp16 and not a.activation_checkpointing and a.deepspeed == "ds_config.json"
        assert (a.learning_rate, a.adam_beta2, a.weight_decay, a.max_grad_norm) == (3e-4, 0.95, 0.1, 1.0)
        # transformers' own check of ds_config.json against the arguments: only the global batch
        # differs, because this test process is one rank, not the plan's two
        assert a.hf_deepspeed_config.mismatches == [
            "- ds train_batch_size=8 vs hf train_batch_size (calculated)=4"]
    cfg = json.loads(Path("ds_config.json").read_text())
    assert cfg["train_batch_size"] == 2 * 1 * 4 and cfg["zero_optimization"]["stage"] == 2
    assert "auto" not in json.dumps(cfg)


def test_hf_trainer_and_accelerate_refuse_3d_plans(capsys, glm_run: Path) -> None:
    for target in ("hf-trainer", "accelerate"):
        rc, out, err = run(capsys, "export", glm_run, "--to", target)
        assert rc == 2 and out == ""
        assert err.strip() == (f"error: --to: {target} cannot express TP/PP (the plan is TP 4 x PP 8) (fix: use "
                               "--to megatron-deepspeed (or --to torchrun for the planner's own worker))")
        assert not (glm_run / "export" / target).exists()


def test_hf_trainer_refuses_partial_recompute(capsys, tmp_path: Path) -> None:
    d = tmp_path / "r"
    assert main(["estimate", *TINY, "--recompute", "full", "--recompute-layers", "1", "--write", str(d)]) == 0
    rc, _, err = run(capsys, "export", d, "--to", "hf-trainer")
    assert rc == 2 and "checkpoints 1 of 4" in err and not (d / "export").exists()


# --- accelerate -----------------------------------------------------------------------------
def test_accelerate_config_loads_with_accelerate(capsys, zero_run: Path, monkeypatch) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, DistributedType
    assert run(capsys, "export", zero_run, "--to", "accelerate")[0] == 0
    d = zero_run / "export" / "accelerate"
    cfg = load_config_from_file(str(d / "accelerate_config.yaml"))
    assert cfg.distributed_type == DistributedType.DEEPSPEED and cfg.mixed_precision == "bf16"
    assert (cfg.num_processes, cfg.num_machines, cfg.use_cpu) == (2, 1, True)
    assert cfg.deepspeed_config == {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": False}
    monkeypatch.chdir(d)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", "accelerate_config.yaml", "train.py"]))
    assert args.use_deepspeed and args.num_processes == 2 and args.deepspeed_config_file == "ds_config.json"
    plugin = DeepSpeedPlugin(hf_ds_config="ds_config.json")
    plugin.set_mixed_precision("bf16")                    # raises if the file's precision disagrees
    assert (plugin.zero_stage, plugin.gradient_accumulation_steps) == (2, 4)


# --- megatron-deepspeed ---------------------------------------------------------------------
# The arguments pretrain_gpt.py accepts, transcribed from deepspeedai/Megatron-DeepSpeed at
# 4efb479d5317ce9b86096b9d8e3e8030b0b5263b, megatron/arguments.py (line of each add_argument);
# --deepspeed/--deepspeed_config are deepspeed.add_config_arguments' (arguments.py line 54).
INT, FLOAT, STR, TRUE = int, float, str, "store_true"
MEGATRON_ARGS = {
    "--tensor-model-parallel-size": INT,       # 1149
    "--pipeline-model-parallel-size": INT,     # 1154
    "--no-pipeline-parallel": TRUE,            # 954
    "--sequence-parallel": TRUE,               # 972
    "--micro-batch-size": INT,                 # 801
    "--global-batch-size": INT,                # 808
    "--num-layers": INT,                       # 602
    "--hidden-size": INT,                      # 616
    "--ffn-hidden-size": INT,                  # 618
    "--num-attention-heads": INT,              # 621
    "--num-key-value-heads": INT,              # 623
    "--seq-length": INT,                       # 1278
    "--max-position-embeddings": INT,          # 630
    "--normalization": ["layernorm", "rmsnorm"],  # 647
    "--layernorm-epsilon": FLOAT,              # 652
    "--swiglu": TRUE,                          # 670
    "--use-rotary-position-embeddings": TRUE,  # 633
    "--rotary-position-embeddings-theta": INT,  # 635
    "--untie-embeddings-and-output-weights": TRUE,  # 680
    "--disable-bias-linear": TRUE,             # 937 (store_false into add_bias_linear)
    "--attention-dropout": FLOAT,              # 768
    "--hidden-dropout": FLOAT,                 # 770
    "--vocab-size": INT,                       # 1269
    "--make-vocab-size-divisible-by": INT,     # 644
    "--recompute-granularity": ["full", "selective"],  # 830
    "--recompute-method": ["uniform", "block"],  # 842
    "--recompute-num-layers": INT,             # 851
    "--checkpoint-activations": TRUE,          # 864
    "--checkpoint-num-layers": INT,            # 871
    "--deepspeed-activation-checkpointing": TRUE,  # 1524
    "--zero-stage": INT,                       # 1487
    "--bf16": TRUE, "--fp16": TRUE,            # 1113, 1111
    "--optimizer": ["adam", "sgd"],            # 940
    "--lr": FLOAT, "--min-lr": FLOAT,          # 1017, 1048
    "--lr-decay-style": ["constant", "linear", "cosine", "inverse-square-root"],  # 1021
    "--lr-warmup-iters": INT, "--train-iters": INT,  # 1036, 873
    "--use-flash-attn-v2": TRUE,               # 930
    "--adam-beta1": FLOAT, "--adam-beta2": FLOAT, "--adam-eps": FLOAT,  # 783, 786, 789
    "--weight-decay": FLOAT, "--clip-grad": FLOAT,  # 772, 781
    "--data-path": "*",                        # 1238 (nargs='*')
    "--data-impl": ["mmap", "infer"],          # 1313
    "--split": STR,                            # 1246
    "--tokenizer-type": ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                         "GPTSentencePieceTokenizer", "HFTokenizer", "NullTokenizer"],  # 1299
    "--tokenizer-model": STR,                  # 1309
    "--distributed-backend": ["nccl", "gloo", "ccl", "hccl"],  # 1170
}


def megatron_parser() -> argparse.ArgumentParser:
    import deepspeed
    ap = argparse.ArgumentParser(allow_abbrev=False)
    for flag, kind in MEGATRON_ARGS.items():
        if kind == TRUE:
            ap.add_argument(flag, action="store_true")
        elif kind == "*":
            ap.add_argument(flag, nargs="*")
        elif isinstance(kind, list):
            ap.add_argument(flag, choices=kind)
        else:
            ap.add_argument(flag, type=kind)
    return deepspeed.add_config_arguments(ap)


def _filled(args_json: Path) -> list[str]:
    """pretrain_gpt_args.json with the ${VAR} placeholders filled, as the script fills them."""
    fill = {"${DATA_PATH}": "/d/corpus_text_document", "${TOKENIZER}": "/m/tok", "${TRAIN_ITERS}": "100"}
    return [fill.get(a, a) for a in json.loads(args_json.read_text())]


def _printargs(tmp: Path) -> Path:
    """A stand-in launcher that prints its arguments as JSON."""
    exe = tmp / "printargs"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_megatron_deepspeed_arguments_parse_and_match_the_plan(capsys, glm_run: Path, tmp_path: Path) -> None:
    rc, out, _ = run(capsys, "export", glm_run, "--to", "megatron-deepspeed", "--out", tmp_path / "m")
    assert rc == 0 and "GeGLU" in out                       # GLM-130B's FFN has no Megatron-DeepSpeed flag
    d = tmp_path / "m"
    env = dict(os.environ, DEEPSPEED=str(_printargs(tmp_path)), DATA_PATH="/d/corpus_text_document",
               TOKENIZER="/m/tok", MEGATRON_DS="/src/Megatron-DeepSpeed", TRAIN_ITERS="10")
    proc = subprocess.run(["bash", str(d / "pretrain_gpt.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)
    launcher, script, margs = argv[:6], argv[6], argv[7:]
    assert launcher == ["--hostfile", "hostfile", "--num_nodes", "96", "--num_gpus", "8"]
    assert script == "/src/Megatron-DeepSpeed/pretrain_gpt.py"
    a = megatron_parser().parse_args(margs)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (4, 8)
    assert (a.micro_batch_size, a.global_batch_size) == (1, 4224) and a.sequence_parallel and not a.no_pipeline_parallel
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (70, 12288, 32768, 96)
    assert (a.seq_length, a.vocab_size, a.attention_dropout) == (2048, 150528, 0.1)
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "uniform", 1)
    # the --recompute-* form only, not the legacy --checkpoint-activations beside it
    assert "--checkpoint-activations" not in margs and "--checkpoint-num-layers" not in margs
    assert a.deepspeed_activation_checkpointing and a.zero_stage == 1 and a.bf16 and not a.fp16
    # the schedule is stated (Megatron's default decay is "linear"); its length comes from TRAIN_ITERS
    assert a.lr_decay_style == "constant" and a.train_iters == 10
    assert a.use_flash_attn_v2 == (json.loads((glm_run / "plan.json").read_text())["inputs"]["train"]["attention"]
                                   == "flash")
    assert a.deepspeed and a.deepspeed_config == "ds_config.json" and a.distributed_backend == "nccl"
    assert a.data_path == ["/d/corpus_text_document"] and a.tokenizer_model == "/m/tok" and a.train_iters == 10
    assert json.loads((d / "pretrain_gpt_args.json").read_text())[:4] == margs[:4]
    cfg = json.loads((d / "ds_config.json").read_text())
    assert cfg["pipeline"]["stages"] == 8 and "stage_layers" not in cfg["pipeline"]     # planner-only key dropped
    # DeepSpeed's partition_balanced gives 70 blocks over 8 stages as 9 x 6 + 8 x 2, the plan's
    # split: the script says so in a comment and warns of nothing
    assert "[9, 9, 9, 9, 9, 9, 8, 8]" in (d / "pretrain_gpt.sh").read_text() and "stage split" not in out
    missing = subprocess.run(["bash", str(d / "pretrain_gpt.sh")], env=dict(env, DATA_PATH=""),
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "set DATA_PATH" in missing.stderr
    no_iters = subprocess.run(["bash", str(d / "pretrain_gpt.sh")], env=dict(env, TRAIN_ITERS=""),
                              capture_output=True, text=True, timeout=60)
    assert no_iters.returncode != 0 and "set TRAIN_ITERS" in no_iters.stderr


def test_megatron_deepspeed_zero_only_and_uneven_stages(capsys, tmp_path: Path) -> None:
    d = tmp_path / "z"
    assert main(["estimate", *TINY, "--zero", "2", "--recompute", "full", "--recompute-layers", "1",
                 "--write", str(d)]) == 0
    assert run(capsys, "export", d, "--to", "megatron-deepspeed")[0] == 0
    a = megatron_parser().parse_args(_filled(d / "export/megatron-deepspeed/pretrain_gpt_args.json"))
    # no pipeline: Megatron's own blocks, block recompute of the first 1 of 4 blocks, rmsnorm, GQA, swiglu
    assert a.no_pipeline_parallel and (a.recompute_method, a.recompute_num_layers) == ("block", 1)
    assert a.normalization == "rmsnorm" and a.swiglu and a.num_key_value_heads is not None
    assert a.distributed_backend == "gloo" and a.zero_stage == 2
    u = tmp_path / "u"
    assert main(["estimate", *GLM130, "--stage-layers", "10,9,9,9,9,8,8,8", "--write", str(u)]) == 0
    rc, out, _ = run(capsys, "export", u, "--to", "megatron-deepspeed")
    assert rc == 0 and "stage split [10, 9, 9, 9, 9, 8, 8, 8]" in out and "no flag" in out
    p = tmp_path / "p"
    assert main(["estimate", *GLM130, "--recompute-layers", "7,7,7,7,7,7,7,7", "--write", str(p)]) == 0
    rc, _, err = run(capsys, "export", p, "--to", "megatron-deepspeed")
    assert rc == 2 and "checkpoints every block or none" in err and not (p / "export").exists()


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_megatron_deepspeed_uses_flash_attention_when_the_estimate_does(capsys, tmp_path: Path, attention) -> None:
    d = tmp_path / attention
    assert main(["estimate", *TINY, "--zero", "1", "--attention", attention, "--write", str(d)]) == 0
    assert json.loads((d / "plan.json").read_text())["inputs"]["train"]["attention"] == attention
    assert run(capsys, "export", d, "--to", "megatron-deepspeed")[0] == 0
    a = megatron_parser().parse_args(_filled(d / "export/megatron-deepspeed/pretrain_gpt_args.json"))
    assert a.use_flash_attn_v2 == (attention == "flash")


def test_hf_trainer_two_node_export_writes_the_hostfile_its_command_names(capsys, tmp_path: Path) -> None:
    """`deepspeed --hostfile hostfile ...` needs the file: DeepSpeed's own launcher parser reads
    the command and its fetch_hostfile reads the file (2 nodes x 8 slots)."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_args
    d = tmp_path / "two"
    assert main(["estimate", "--model", "glm-10b", "--gpus", "2x8xH100", "--zero", "2", "--write", str(d)]) == 0
    rc, out, _ = run(capsys, "export", d, "--to", "hf-trainer")
    assert rc == 0, out
    e = d / "export" / "hf-trainer"
    launch = next(ln.split("start: ", 1)[1].split(" (from ")[0] for ln in out.splitlines() if ln.startswith("start: "))
    argv = shlex.split(launch.replace("$(cat train.args)", ""))
    assert argv[0] == "deepspeed"
    a = parse_args(argv[1:])
    assert (a.hostfile, a.num_nodes, a.num_gpus) == ("hostfile", 2, 8)
    hosts = fetch_hostfile(str(e / a.hostfile))
    assert list(hosts.values()) == [8, 8]


# --- torchrun -------------------------------------------------------------------------------
def test_torchrun_command_parses_with_torchrun(capsys, glm_run: Path, zero_run: Path, tmp_path: Path) -> None:
    from torch.distributed.run import get_args_parser
    for rd, nnodes, nproc in ((zero_run, 1, 2), (glm_run, 96, 8)):
        assert run(capsys, "export", rd, "--to", "torchrun", "--out", tmp_path / rd.parent.name)[0] == 0
        env = dict(os.environ, TORCHRUN=str(_printargs(tmp_path)), MASTER_ADDR="10.0.0.1")
        proc = subprocess.run(["bash", str(tmp_path / rd.parent.name / "torchrun.sh"), "--steps", "3"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        a = get_args_parser().parse_args(json.loads(proc.stdout))
        assert (a.nnodes, a.nproc_per_node, a.module, a.training_script) == (str(nnodes), str(nproc), True,
                                                                             "planner.runtime.train.worker")
        assert a.training_script_args == ["--run-dir", str(rd.resolve()), "--steps", "3"]
        if nnodes > 1:
            assert a.rdzv_backend == "c10d" and a.rdzv_endpoint == "10.0.0.1:29500"
        else:
            assert a.standalone


def test_export_of_a_missing_run_is_one_line(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "export", tmp_path / "nope", "--to", "torchrun")
    assert rc == 2 and "is not a directory" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, "export", tmp_path, "--to", "nosuch")
    assert rc == 2 and "--to" in err
