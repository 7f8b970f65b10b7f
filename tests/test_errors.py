"""Bad input: a typed error with one clear sentence; on the CLI that sentence and exit code 2."""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import build_checkpoint, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.core.base.errors import ArtifactError, InputError, ModelDirError, UnsupportedModelError, WeightError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=50, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )
    build_checkpoint(cfg, path)
    return path


def copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_directory(tmp_path, capsys):
    with pytest.raises(ModelDirError, match="does not exist"):
        npumoe.load(tmp_path / "nope")
    assert "does not exist" in cli_error(capsys, "inspect", str(tmp_path / "nope"))


def test_missing_config(tmp_path, capsys):
    with pytest.raises(ModelDirError, match="no config.json"):
        npumoe.load(tmp_path)
    assert "config.json" in cli_error(capsys, "generate", "--model", str(tmp_path))


def test_unknown_model_type_lists_supported(tiny, tmp_path, capsys):
    path = copy_checkpoint(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported; supported: .*qwen3_moe"):
        npumoe.load(path)
    assert "qwen3_moe" in cli_error(capsys, "inspect", str(path))


def test_quantized_checkpoint_is_refused(tiny, tmp_path, capsys):
    path = copy_checkpoint(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedModelError, match=r"quantized \(awq\).*dequantized copy"):
        npumoe.load(path)
    assert "quantized" in cli_error(capsys, "inspect", str(path))


def test_missing_tensor_is_named(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor 'layers\.1\.attn\.k\.weight'"):
        npumoe.load(path)


def test_misshaped_tensor_names_both_shapes(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.mlp.experts.2.up_proj.weight"] = torch.zeros(8, 32)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'layers\.0\.moe\.experts\.2\.up\.weight'.*\[8, 32\].*\[16, 32\]"):
        npumoe.load(path)


def test_pickle_checkpoint_is_refused_unread(tiny, tmp_path, capsys):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (path / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(WeightError, match="never unpickles"):
        npumoe.load(path)
    assert "safetensors" in cli_error(capsys, "generate", "--model", str(path), "--ids", "1")


def test_empty_prompt(tiny, capsys):
    eng = npumoe.Engine(npumoe.load(tiny))
    with pytest.raises(InputError, match="empty"):
        eng.forward(np.array([], dtype=np.int64))
    with pytest.raises(InputError, match="empty"):
        eng.generate([], max_new_tokens=2)
    assert "empty" in cli_error(capsys, "generate", "--model", str(tiny), "--prompt", "")


def test_token_outside_vocabulary(tiny, capsys):
    eng = npumoe.Engine(npumoe.load(tiny))
    with pytest.raises(InputError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        eng.forward([1, 2, 50])
    with pytest.raises(InputError, match="outside the vocabulary"):
        eng.forward([-1])
    assert "outside the vocabulary" in cli_error(capsys, "generate", "--model", str(tiny), "--ids", "3,99")


def decode_after_a_prompt(engine, token):
    engine.generate([1, 2], max_new_tokens=1)
    return engine.decode(token)


@pytest.mark.parametrize("call, message", [
    (lambda eng, m: eng.generate([1, 2], max_new_tokens=-3), "max_new_tokens must be a whole number ≥ 0, got -3"),
    (lambda eng, m: eng.generate([1, 2], max_new_tokens=2.5), "max_new_tokens must be a whole number ≥ 0, got 2.5"),
    (lambda eng, m: eng.decode(5), "decode continues a sequence, and none has started: run forward or generate"),
    (lambda eng, m: decode_after_a_prompt(eng, "7"), "a token id must be a whole number ≥ 0, got '7'"),
    (lambda eng, m: npumoe.Engine(m, chunk=-1), "chunk must be a whole number ≥ 1, got -1"),
    (lambda eng, m: npumoe.Engine(m, max_context=2.5), "max_context must be a whole number ≥ 1, got 2.5"),
    (lambda eng, m: npumoe.calibrate(m, []), "no calibration text was given"),
    (lambda eng, m: npumoe.calibrate(m, None), "calibrate takes a list of texts"),
    (lambda eng, m: npumoe.calibrate(m, [list(range(20))], chunk=0), "chunk must be a whole number ≥ 1, got 0"),
])
def test_library_calls_out_of_range_raise_typed_errors(tiny, call, message):
    """A negative max_new_tokens silently returned nothing, a decode before any prompt or a chunk of 0 failed as
    an IndexError, ZeroDivisionError or a torch error deep inside."""
    model = npumoe.load(tiny)
    with pytest.raises(InputError, match=message):
        call(npumoe.Engine(model, chunk=4, max_context=16), model)


def test_prompt_longer_than_cache(tiny):
    eng = npumoe.Engine(npumoe.load(tiny), chunk=4, max_context=8)
    with pytest.raises(InputError, match="KV cache"):
        eng.forward(list(range(9)))
    with pytest.raises(InputError, match="KV cache"):
        eng.generate(list(range(6)), max_new_tokens=4)


def with_config(tiny, tmp_path, **edits):
    """A copy of the tiny checkpoint whose config.json has ``edits`` applied (None removes a key)."""
    path = copy_checkpoint(tiny, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **edits}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("edits, message", [
    (dict(num_hidden_layers=0), "num_hidden_layers is 0, but it must be a whole number ≥ 1"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok is 0, but it must be a whole number ≥ 1"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok is 5, but each MoE layer has 4 experts; set it between 1 and 4"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps is -1e-06, but it must be a positive number"),
    (dict(hidden_size="32"), "hidden_size is '32', but it must be a whole number ≥ 1"),
    (dict(num_attention_heads=True), "num_attention_heads is True, but it must be a whole number ≥ 1"),
    (dict(num_key_value_heads=3, num_attention_heads=4), r"num_attention_heads \(4\) is not a multiple of "
                                                          r"num_key_value_heads \(3\)"),
    (dict(rope_scaling=[1, 2]), "rope_scaling is \\[1, 2\\], but it must be a JSON object"),
    (dict(eos_token_id="</s>"), "eos_token_id is '</s>', but it must be a token id or a list of them"),
    (dict(model_type=["qwen3_moe"]), "model_type is \\['qwen3_moe'\\], but it must be a JSON string"),
    # incomplete or wrong rope settings were a KeyError, a TypeError or a ValueError inside the rope tables
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.rope_type is 'linear', which needs 'factor', but it "
                                                 "has none"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3', which needs 'low_freq_factor'"),
    (dict(rope_scaling={"type": "yarn", "factor": "4"}), "rope_scaling.factor is '4', but it must be a positive "
                                                         "number"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0]}),
     r"short_factor has 1 values, but the 16 rotated dims of a head take one per pair, 8"),  # was broadcast silently
    (dict(rope_scaling={"partial_rotary_factor": "0.5"}), r"partial_rotary_factor is '0.5', but it must be a number in "
                                                          r"\(0, 1\]"),
])
def test_impossible_config_values_are_named_before_loading(tiny, tmp_path, capsys, edits, message):
    path = with_config(tiny, tmp_path, **edits)
    with pytest.raises(UnsupportedModelError, match=message):
        npumoe.load(path)
    assert "config.json" in cli_error(capsys, "inspect", str(path))


def test_a_config_that_is_not_an_object(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "config.json holds a JSON list, not an object" in cli_error(capsys, "inspect", str(tmp_path))


def test_a_chunk_the_machine_cannot_hold_is_refused_before_allocating(tiny, capsys):
    err = cli_error(capsys, "generate", "--model", str(tiny), "--ids", "1", "--chunk", "1000000000")
    assert "--chunk 1000000000 with a" in err and "GB is free; use a smaller --chunk" in err


@pytest.mark.parametrize("content, reason", [
    (b"\x00 not json", "is not a tokenizer the `tokenizers` package can read"),
    (None, "is a directory, not a tokenizer file"),
])
def test_an_unreadable_tokenizer_is_named_and_ids_still_run(tiny, tmp_path, capsys, content, reason):
    path = copy_checkpoint(tiny, tmp_path / "m")
    if content is None:
        (path / "tokenizer.json").mkdir()
    else:
        (path / "tokenizer.json").write_bytes(content)
    err = cli_error(capsys, "generate", "--model", str(path), "--prompt", "hello", "-n", "1")
    assert "tokenizer.json " + reason in err and "pass token ids with --ids" in err
    assert len(npumoe.Engine(npumoe.load(path)).generate([1, 2], max_new_tokens=1)) == 1


def test_a_directory_where_a_file_is_expected_is_called_a_directory(tiny, tmp_path, capsys):
    assert "is a directory, not a file; expected a plan" in cli_error(
        capsys, "generate", "--model", str(tiny), "--ids", "1", "--plan", str(tmp_path))
    assert "is a directory, not a file; expected calibration text" in cli_error(
        capsys, "calibrate", "--model", str(tiny), "--text", str(tmp_path), "--out", str(tmp_path / "p.json"))
    assert "is a file, not a model directory" in cli_error(capsys, "inspect", str(tiny / "config.json"))


# -- artifacts bound to the plan they were built from -----------------------------------------------------
@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """The tiny model's CPU plan with every expert 'on the NPU' (so it has graphs to build), saved and built."""
    from npumoe.core.compiler.artifacts import build

    model = npumoe.load(tiny)
    out = tmp_path_factory.mktemp("built")
    plan = npumoe.plan(model, npumoe.calibrate(model, [list(range(50))], chunk=4), target="cpu", residency="npu")
    plan.save(out / "plan.json")
    build(model, plan, "cpu", out / "build", max_context=16, progress=False)
    return out


def edited_build(built, tmp_path, edit):
    """A copy of the build whose manifest ``edit(manifest)`` changed in place."""
    path = copy_checkpoint(built / "build", tmp_path / "build")
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def swap_first_experts(plan_json: dict) -> dict:
    group = plan_json["layers"]["1"]["groups"][0]
    group["experts"][:2] = group["experts"][1::-1]
    return plan_json


@pytest.mark.parametrize("edit", [
    lambda m: swap_first_experts(m["plan"]),  # ran the compiled groups as the wrong experts, with exit 0
    lambda m: m.update(max_context=32),  # would feed graphs compiled for 16 cache slots 32
])
def test_a_plan_or_context_edited_inside_the_manifest_is_refused(tiny, built, tmp_path, capsys, edit):
    path = edited_build(built, tmp_path, edit)
    with pytest.raises(ArtifactError, match="plan or max_context no longer matches its build_sha256; it was altered "
                                            "after the build"):
        npumoe.Engine(npumoe.load(tiny), artifacts=path)
    assert "build_sha256" in cli_error(capsys, "generate", "--model", str(tiny), "--artifacts", str(path), "--ids", "1")


def test_a_manifest_from_before_plans_were_bound_is_refused(tiny, built, tmp_path):
    path = edited_build(built, tmp_path, lambda m: m.pop("build_sha256"))
    with pytest.raises(ArtifactError, match="records no build_sha256 .*rebuild with npumoe build"):
        npumoe.Engine(npumoe.load(tiny), artifacts=path)


@pytest.mark.parametrize("field, value, message", [
    ("chunk", 8, "holds chunk 8 but its plan's is 4"),
    ("target", "htp", "holds target 'htp' but its plan's is 'cpu'"),
])
def test_a_manifest_disagreeing_with_its_plan_is_refused(tiny, built, tmp_path, field, value, message):
    path = edited_build(built, tmp_path, lambda m: m.update({field: value}))
    with pytest.raises(ArtifactError, match=message):
        npumoe.Engine(npumoe.load(tiny), artifacts=path)


def test_a_build_is_loaded_only_by_the_backend_that_made_it(tiny, built):
    from npumoe.backends.cpu.backend import CpuBackend
    from npumoe.core.compiler.artifacts import load_executors
    from npumoe.core.compiler.program import build_program

    class OtherNpu(CpuBackend):
        name = "other"

    model = npumoe.load(tiny)
    program = build_program(model.spec, chunk=4, max_context=16, plan=npumoe.Plan.load(built / "plan.json"))
    npu = [g for g in program.graphs.values() if g.placement == "npu"]
    assert load_executors(CpuBackend(), built / "build", npu, model.weights, model)
    with pytest.raises(ArtifactError, match="holds a build for cpu, which other cannot load; pass --target cpu"):
        load_executors(OtherNpu(), built / "build", npu, model.weights, model)


def test_a_plan_other_than_the_artifacts_one_is_refused_naming_the_difference(tiny, built, tmp_path, capsys):
    model = npumoe.load(tiny)
    plan = npumoe.Plan.load(built / "plan.json")
    swapped = npumoe.Plan.from_json(swap_first_experts(plan.to_json()))
    experts = plan.layers[1].groups[0].experts
    with pytest.raises(ArtifactError, match=rf"its layers\.1\.groups\.0\.experts\.0 is {experts[1]}, the artifacts' "
                                            rf"{experts[0]}; run without --plan"):
        npumoe.Engine(model, plan=swapped, artifacts=built / "build")
    npumoe.Engine(model, plan=plan, artifacts=built / "build").forward([1, 2, 3])  # the very plan runs
    other_chunk = npumoe.plan(model, npumoe.calibrate(model, [list(range(50))], chunk=8), target="cpu",
                              residency="npu")
    other_chunk.save(tmp_path / "chunk8.json")
    err = cli_error(capsys, "generate", "--model", str(tiny), "--plan", str(tmp_path / "chunk8.json"), "--artifacts",
                    str(built / "build"), "--ids", "1,2")
    assert "the plan passed (--plan) is not the one" in err and "its chunk is 8, the artifacts' 4" in err
    other_target = npumoe.plan(model, npumoe.calibrate(model, [list(range(50))], chunk=4), target="htp")
    with pytest.raises(ArtifactError, match="its target is \"htp\", the artifacts' \"cpu\""):
        npumoe.Engine(model, plan=other_target, artifacts=built / "build")


def huge_capacity(groups):
    groups[0]["shapes"][0][0] = 2 ** 63


def capacity_for_a_shape(groups):
    groups[0]["shapes"][0] = 5


def an_empty_group(groups):
    groups.append({**groups[0], "experts": [], "shapes": [[]]})


@pytest.mark.parametrize("edit, message", [
    (huge_capacity, r"shapes .* hold a capacity outside 1-8 \(chunk 4 × top-k 2"),
    (capacity_for_a_shape, r"its 'shapes' is \[5, .*not a list\[list\[int\]\]"),
    (an_empty_group, "do not hold each of its 4 experts once"),
])
def test_impossible_plan_values_are_named_before_running(tiny, built, tmp_path, capsys, edit, message):
    """Plan files are input: a capacity of 2^63 overflowed inside the runtime, one given as a number where a
    shape belongs failed as a TypeError, an empty group as a ValueError."""
    plan = json.loads((built / "plan.json").read_text())
    edit(plan["layers"]["1"]["groups"])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(ArtifactError, match=message):
        npumoe.Engine(npumoe.load(tiny), plan=npumoe.Plan.load(tmp_path / "plan.json"))
    assert "make a new one with npumoe plan" in cli_error(capsys, "generate", "--model", str(tiny), "--plan",
                                                          str(tmp_path / "plan.json"), "--ids", "1")


def test_a_prompt_that_is_not_utf8_is_refused_not_replaced(tiny, tmp_path, capsys):
    """A shell in another locale hands bytes that are not UTF-8 to Python as lone surrogates: they were a
    UnicodeEncodeError traceback; replaced by U+FFFD they would continue another prompt than the one given."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    not_utf8 = b"def f\xff(x)".decode("utf-8", errors="surrogateescape")
    demo = npumoe.load()
    with pytest.raises(InputError, match="the prompt is not valid UTF-8: character 5 is the byte 0xff"):
        demo.tokenizer.encode(not_utf8)
    assert demo.tokenizer.encode("def f\u00ff(x)") == list("def f\u00ff(x)".encode())  # valid text still encodes
    assert "pass token ids with --ids" in cli_error(capsys, "generate", "--prompt", not_utf8, "-n", "1")
    path = copy_checkpoint(tiny, tmp_path / "m")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(path / "tokenizer.json"))
    hf = npumoe.load(path).tokenizer
    assert hf.encode("def def") == [1, 1]
    with pytest.raises(InputError, match="character 1 is the lone surrogate U\\+D800"):
        hf.encode("d\ud800ef")


FAMILY_CONFIGS = ("Qwen3MoeConfig", "Qwen2MoeConfig", "MixtralConfig", "PhimoeConfig", "OlmoeConfig", "DeepseekV3Config",
                  "GptOssConfig")


@pytest.mark.parametrize("config_class", FAMILY_CONFIGS)
def test_a_null_or_missing_config_value_is_a_default_or_one_line(config_class):
    """Every key of each family's transformers config, set to null or left out: the spec reads a default, or the
    config is refused with npumoe's one line (a null top-k, eps or SwiGLU limit was a TypeError)."""
    from npumoe.models.checks import check_config
    from npumoe.models.loader import config_spec

    base = getattr(transformers, config_class)(num_hidden_layers=2).to_dict()
    config_spec(check_config(dict(base)))
    for key in sorted(base):
        for cfg in ({**base, key: None}, {k: v for k, v in base.items() if k != key}):
            try:
                config_spec(check_config(cfg))
            except npumoe.NpumoeError as err:
                assert "\n" not in str(err)


@pytest.mark.parametrize("command", [["generate", "-n", "2"], ["build", "--target", "htp"]])
def test_a_compute_dtype_the_cpu_has_no_kernels_for_is_refused_with_the_alternative(capsys, command):
    err = cli_error(capsys, *command, "--dtype", "float16")
    assert err == ("error: --dtype float16 has no CPU kernels (torch runs it many times slower than float32); use "
                   "--dtype bfloat16 for 2 bytes a weight on the bf16 kernels, or auto.")


def test_a_plans_chunk_the_machine_cannot_hold_names_the_plan(tiny, built, tmp_path, capsys):
    plan = json.loads((built / "plan.json").read_text())
    (tmp_path / "plan.json").write_text(json.dumps(plan | {"chunk": 10**9}))
    err = cli_error(capsys, "generate", "--model", str(tiny), "--plan", str(tmp_path / "plan.json"), "--ids", "1")
    assert err.startswith("error: the plan's chunk 1000000000 with a") and err.endswith(
        "GB is free; make a plan with a smaller --chunk (or --max-context)."), err


def test_a_build_for_another_target_is_not_run_on_the_cpu(tiny, tmp_path, capsys):
    """generate --artifacts B without --target ran an NPU build's model on the CPU, ignoring B, as if it were B's."""
    pytest.importorskip("mlx.core", reason="the other target here is mlx")
    from npumoe.core.compiler.artifacts import build

    model = npumoe.load(tiny)
    plan = npumoe.plan(model, npumoe.calibrate(model, [list(range(50))], chunk=4), target="mlx", residency="npu")
    build(model, plan, "mlx", tmp_path / "mlx-build", max_context=16, progress=False)
    other = tmp_path / "mlx-build"
    err = cli_error(capsys, "generate", "--model", str(tiny), "--artifacts", str(other), "--ids", "1,2", "-n", "2")
    assert err == f"error: {other} holds a build for 'mlx', not 'cpu'; pass --target mlx (backend='mlx') to run it."
