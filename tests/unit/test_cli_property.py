"""Property: random and malformed specs and flags never end in a traceback.

Every call of the loaders either returns a spec or raises SpecError/PlannerError; every
CLI call exits 0 (it worked) or 2 (one line on stderr naming the problem) -- never 3
(an internal error) and never a traceback.
"""
from __future__ import annotations

import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.errors import PlannerError
from planner.specs.hf import FAMILIES, load_hf_config, spec_from_hf
from planner.specs.presets import PRESETS

KEYS = ["hidden_size", "num_layers", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "multi_query_attention", "multi_query_group_num", "ffn_hidden_size", "intermediate_size", "inner_hidden_size",
        "vocab_size", "padded_vocab_size", "seq_length", "max_position_embeddings", "max_sequence_length", "n_embd",
        "n_layer", "n_head", "n_inner", "n_positions", "head_dim", "kv_channels", "tie_word_embeddings",
        "attention_bias", "rmsnorm", "hidden_act", "_name_or_path"]
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=False),
                        st.text(max_size=8))
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                         max_size=3), max_leaves=6)
small_int = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), st.integers(-2, 5000))
configs = st.fixed_dictionaries(
    {"model_type": st.one_of(st.sampled_from(sorted(FAMILIES)), json_scalar)},
    optional={k: st.one_of(small_int, json_value) for k in KEYS})

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(configs)
def test_hf_loader_never_crashes(cfg):
    try:
        spec = spec_from_hf(cfg)
    except PlannerError as exc:
        assert "\n" not in exc.line()
    else:
        assert spec.params > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=64), configs.map(lambda c: json.dumps(c).encode()).map(lambda b: b[:len(b) // 2])))
def test_hf_files_never_crash(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_bytes(data)
    try:
        load_hf_config(path)
    except PlannerError as exc:
        assert "\n" not in exc.line()


gpu_types = st.sampled_from(["A100", "A100-40GB", "H100-SXM", "H200", "V100", "L40S", "cpu", "B200", "a100", ""])
junk_gpus = st.one_of(
    st.builds(lambda n, g, t: f"{n}x{g}x{t}", st.integers(-1, 12), st.integers(-1, 9), gpu_types),
    st.text(alphabet=string.printable, max_size=12))
junk_models = st.text(alphabet=string.ascii_letters + "-./", max_size=12)
junk_ints = st.one_of(st.integers(-3, 9), st.sampled_from([0, 10**9]), st.text(max_size=3))


@st.composite
def flags(draw):
    """Plausible values (most runs get a real estimate or a precise complaint), with a few
    fields -- drawn at random -- replaced by junk."""
    v = {"model": draw(st.sampled_from(sorted(PRESETS))),
         "gpus": draw(st.sampled_from(["8xA100", "2x8xH100", "4xA100-40GB", "2xcpu", "16x8xA100-40GB", "8xV100"])),
         "tp": draw(st.sampled_from([1, 2, 4, 8])), "pp": draw(st.sampled_from([1, 2, 4])),
         "zero": draw(st.sampled_from([0, 1, 2, 3])), "mb": draw(st.sampled_from([1, 2, 4])),
         "batch": draw(st.sampled_from([8, 64, 512])), "seq": draw(st.sampled_from([128, 1024, 4096])),
         "v": draw(st.sampled_from([1, 1, 2])), "scale": draw(st.sampled_from([None, None, "tiny", "small"]))}
    junk = {"model": junk_models, "gpus": junk_gpus, "scale": st.sampled_from(["huge", ""])}
    for key in draw(st.lists(st.sampled_from(sorted(v)), max_size=3, unique=True)):
        v[key] = draw(junk.get(key, junk_ints))
    return v


def _cli(capsys, argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc in (0, 2), (argv, err)
    assert "Traceback" not in err and "Traceback" not in out
    if rc == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    return rc, out


OUTCOMES: dict[str, set[int]] = {"estimate": set(), "search": set()}


@SETTINGS
@given(f=flags(), recompute=st.sampled_from(["none", "selective", "full", "half"]), sp=st.booleans(),
       as_json=st.booleans())
def test_estimate_never_crashes(capsys, f, recompute, sp, as_json):
    argv = ["estimate", "--model", f["model"], "--gpus", f["gpus"], "--tp", f["tp"], "--pp", f["pp"], "--zero",
            f["zero"], "--micro-batch", f["mb"], "--global-batch", f["batch"], "--seq-len", f["seq"], "--recompute",
            recompute, "--interleave", f["v"]]
    argv += ["--sequence-parallel"] * sp + (["--scale", f["scale"]] if f["scale"] is not None else [])
    argv += ["--json"] * as_json
    rc, out = _cli(capsys, argv)
    OUTCOMES["estimate"].add(rc)
    if rc == 0 and as_json:
        assert "step_time_s" in json.loads(out)


def test_estimate_property_saw_both_outcomes(capsys):
    """The property above must exercise real estimates, not only rejections."""
    if not OUTCOMES["estimate"]:
        test_estimate_never_crashes(capsys=capsys)
    assert OUTCOMES["estimate"] == {0, 2}


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(f=flags(), name=st.one_of(st.none(), st.text(max_size=6)))
def test_search_never_crashes(capsys, tmp_path, f, name):
    argv = ["search", "--model", f["model"], "--gpus", f["gpus"], "--global-batch", f["batch"], "--seq-len", f["seq"],
            "--trials", 3, "--out-dir", tmp_path / "reports", "--scale", f["scale"] or "tiny"]
    argv += ["--name", name] if name is not None else []
    rc, _ = _cli(capsys, argv)
    OUTCOMES["search"].add(rc)
