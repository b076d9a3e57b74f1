"""EP size and context-parallel degree are searched axes, with each runtime's rules."""
import pytest

from planner.cli import main
from planner.search.space import Space
from planner.specs.hardware import parse_cluster
from planner.specs.presets import preset, scale
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems


def test_ep_is_searched_for_moe_only():
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=16, seq_len=4096)
    eps = {o.ep for o in Space(model=preset("glm-4.5-air"), cluster=c, train=tr).points()}
    assert eps == {1, 2, 4, 8}
    assert {o.ep for o in Space(model=preset("glm-4-9b"), cluster=c, train=tr).points()} == {1}


def test_cp_offered_for_long_sequences_and_every_point_is_legal():
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    long = TrainSpec(global_batch=16, seq_len=65536)
    space = Space(model=m, cluster=c, train=long)
    points = list(space.points())
    kinds = {(o.cp, o.cp_kind) for o in points}
    assert (2, "ulysses") in kinds and (8, "ring") in kinds and (4, "ulysses") not in kinds  # 2 KV groups
    for o in points[::7]:
        assert not plan_problems(m, c, long, o.plan(long.precision)), o
    short = TrainSpec(global_batch=16, seq_len=4096)
    assert {o.cp for o in Space(model=m, cluster=c, train=short).points()} == {1}
    assert {o.cp for o in Space(model=m, cluster=c, train=short, context_parallel="on").points()} > {1}


def test_tiny_moe_space_is_legal():
    m = scale(preset("glm-4.5-air"), "tiny")
    c, tr = parse_cluster("4xcpu"), TrainSpec(global_batch=8, seq_len=128, precision="fp32")
    for o in Space(model=m, cluster=c, train=tr).points():
        assert not plan_problems(m, c, tr, o.plan(tr.precision)), o


@pytest.mark.parametrize("flags,words", [
    (["--model", "glm-4.5-air", "--gpus", "4x8xH100", "--ep", "3", "--pp", "4"], "--ep: 3 does not divide"),
    (["--model", "glm-4.5-air", "--gpus", "4x8xH100", "--ep", "3", "--pp", "4", "--cp", "3"], "--tp/--pp/--cp"),
    (["--model", "glm-4-9b", "--gpus", "8xA100-80GB", "--cp", "4", "--seq-len", "65536", "--zero", "3",
      "--global-batch", "16"], "does not divide the 2 KV groups"),
    (["--model", "glm-4-9b", "--gpus", "8xA100-80GB", "--cp", "4", "--cp-kind", "ring", "--seq-len", "65532",
      "--zero", "3", "--global-batch", "16"], "divisible by 2 x cp = 8"),
    (["--model", "glm-4-9b", "--gpus", "8xA100-80GB", "--ep", "2", "--global-batch", "16"], "mixture-of-experts"),
])
def test_bad_ep_cp_is_one_line_exit_2(capsys, flags, words):
    rc = main(["estimate", *flags])
    _, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err


CONFIG = {"model_type": "glm4_moe", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
          "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64, "vocab_size": 1000,
          "max_position_embeddings": 65536, "moe_intermediate_size": 256, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1}
"""A small glm4_moe config.json: 8 experts top-2, 12 heads (so Ulysses cp 8 fails on the heads, not the KV groups)."""


@pytest.mark.parametrize("edit,flags,words", [
    (dict(num_experts_per_tok=16), [], "top_k: 16 is larger than the 8 experts"),
    (dict(moe_intermediate_size=None), [], "moe_intermediate_size: missing"),
    ({}, ["--gpus", "3x8xH100", "--ep", "3"], "plan.ep 3 does not divide the 8 experts"),
    ({}, ["--ep", "16"], "--ep: 16 does not divide the data-parallel size 8"),
    ({}, ["--cp", "8", "--seq-len", "65536", "--global-batch", "16"], "does not divide the 12 attention heads"),
    ({}, ["--cp", "2", "--seq-len", "65535", "--global-batch", "16"], "needs seq_len 65535 divisible by 2"),
])
def test_bad_moe_config_and_degrees_are_one_line_exit_2(tmp_path, capsys, edit, flags, words):
    """Issue 22's bad input through `planner estimate --model config.json`: top-k over the experts, a
    missing expert field, EP not dividing the experts or the DP ranks, Ulysses not dividing the
    heads or the sequence."""
    import json
    cfg = {k: v for k, v in {**CONFIG, **edit}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["estimate", "--model", str(tmp_path / "config.json"), "--gpus", "8xH100", *flags]
    rc = main(args[:3] + args[5:] if "--gpus" in flags else args)
    _, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
