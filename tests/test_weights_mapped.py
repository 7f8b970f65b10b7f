"""Weights stay in their files: mapped in the stored dtype, read only when a graph needs them.

The truths: transformers (fp32 and bf16) for the numbers, the safetensors files themselves for
what is mapped, and a counting reader for what a command reads.
"""

import json

import numpy as np
import pytest
import torch
from cli_check import cli_error
from hf_compare import LOGIT_TOL, build_checkpoint, hf_routing, transformers
from safetensors.torch import load_file, save_file

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import WeightError
from npumoe.core.ir.tensorfile import SafetensorsFile, SafetensorsWriter

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=128, norm_topk_prob=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory):
    """A bf16 checkpoint in several shards with its index, as the Hub stores large models."""
    path = tmp_path_factory.mktemp("bf16")
    build_checkpoint(transformers.Qwen3MoeConfig(**CONFIG), path / "fp32")
    hf_load(path / "fp32", torch.bfloat16).save_pretrained(path / "ckpt", max_shard_size="20KB")
    assert len(list((path / "ckpt").glob("*.safetensors"))) >= 2
    return path / "ckpt"


def hf_load(path, dtype):
    """transformers' model from the files in ``dtype`` (its rope tables made fresh in fp32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


class CountingReads:
    def __init__(self, monkeypatch):
        self.count = 0
        original = SafetensorsFile.tensor

        def counted(file, key):
            self.count += 1
            return original(file, key)

        monkeypatch.setattr(SafetensorsFile, "tensor", counted)


def test_fp32_policy_on_bf16_files_matches_transformers_fp32(sharded_bf16):
    """Mapped bf16 weights computed in fp32 give transformers' fp32 logits on the same values."""
    path = sharded_bf16
    model = npumoe.load(path, dtype="float32")
    assert model.weights.dtype == torch.float32
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], 13)
    ref, _ = hf_routing(hf_load(path, torch.float32), ids)
    np.testing.assert_allclose(npumoe.Engine(model, chunk=8).forward(ids), ref, atol=LOGIT_TOL, rtol=0)


def test_bf16_policy_against_transformers_bf16(sharded_bf16):
    """bf16 matrices, fp32 activations, norms and router: the same experts as transformers' fp32 on
    almost every token, logits as close to fp32 as transformers' own bf16, the same argmax."""
    path = sharded_bf16
    model = npumoe.load(path, dtype="bfloat16")
    assert model.weights["layers.0.attn.q.weight"].dtype == torch.bfloat16
    assert model.weights["layers.0.moe.router.weight"].dtype == torch.float32  # picks the experts
    assert model.weights["layers.0.attn_norm.weight"].dtype == torch.float32
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], 24)
    routed = {}
    eng = npumoe.Engine(model, chunk=8, on_route=lambda i, e, w, a: routed.setdefault(i, []).append(e.numpy()))
    ours = eng.forward(ids)
    ref_bf16, _ = hf_routing(hf_load(path, torch.bfloat16), ids)
    ref_fp32, picks = hf_routing(hf_load(path, torch.float32), ids)
    same = np.ones(len(ids), dtype=bool)  # tokens whose experts are fp32's in every layer
    for layer, ref_idx in zip(model.spec.moe_layers, picks):
        mine = np.sort(np.concatenate(routed[layer]), axis=1)
        same &= (mine == np.sort(ref_idx.reshape(mine.shape), axis=1)).all(axis=1)
    assert same.mean() >= 0.9, same
    # until a near-tied expert flips (rounding decides it; later tokens see it through attention), no further
    # from fp32 than transformers' bf16; past it, within the stated bound of transformers' bf16
    agree = len(ids) if same.all() else int(np.argmin(same))
    their_err = np.abs(ref_bf16 - ref_fp32).max()
    assert agree >= 8 and np.abs(ours - ref_fp32)[:agree].max() <= 1.5 * their_err
    assert np.abs(ours - ref_bf16).max() < 0.1
    assert (ours.argmax(-1) == ref_bf16.argmax(-1)).mean() >= 0.9


def test_bf16_policy_maps_matrices_without_copying(sharded_bf16):
    path = sharded_bf16
    weights = npumoe.load(path, dtype="bfloat16").weights
    a, b = weights["layers.1.moe.experts.3.down.weight"], weights["layers.1.moe.experts.3.down.weight"]
    assert a.data_ptr() == b.data_ptr()  # both views of the one mapping, not copies
    assert mapped_file(a.data_ptr()).endswith(".safetensors")  # the kernel says: that memory is the file


def mapped_file(address: int) -> str:
    """The file /proc/self/maps shows mapped at ``address`` ('' for anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    return ""


def test_auto_policy_computes_from_bf16_where_the_kernels_are_faster_else_fp32_when_it_fits(sharded_bf16):
    from npumoe.core.ir.weights import resolve_dtype
    from npumoe.luts.torch_op import fast_compute_dtypes

    weights = npumoe.load(sharded_bf16).weights
    assert weights.dtype == (torch.bfloat16 if torch.bfloat16 in fast_compute_dtypes() else torch.float32)
    sources = {name: weights.source(name) for name in weights}
    assert resolve_dtype("auto", sources, weights.spec, lambda: frozenset()) == torch.float32  # small: fits
    assert resolve_dtype("auto", sources, weights.spec, lambda: frozenset({torch.bfloat16})) == torch.bfloat16
    assert weights["layers.0.moe.router.weight"].dtype == torch.float32  # the router's scores stay fp32


def test_inspect_and_plan_read_no_tensor_data(sharded_bf16, tmp_path, monkeypatch, capsys):
    path = sharded_bf16
    ids = np.random.default_rng(2).integers(0, CONFIG["vocab_size"], 200).tolist()
    profile = npumoe.calibrate(npumoe.load(path), [ids], chunk=16).save(tmp_path / "profile.json")
    reads = CountingReads(monkeypatch)
    for argv in (["inspect", str(path)],
                 ["plan", "--model", str(path), "--profile", str(profile), "--out", str(tmp_path / "plan.json")]):
        run_cli(argv)
    assert reads.count == 0
    assert (tmp_path / "plan.json").is_file()
    assert "bf16" in capsys.readouterr().out


def run_cli(argv) -> None:
    try:
        main(argv)
    except SystemExit as done:
        assert done.code in (0, None)


def test_missing_shard_is_named(sharded_bf16, tmp_path, capsys):
    path = sharded_bf16
    copy = tmp_path / "m"
    copy.mkdir()
    shards = sorted(path.glob("*.safetensors"))
    for f in path.iterdir():
        if f != shards[1]:
            (copy / f.name).write_bytes(f.read_bytes())
    with pytest.raises(WeightError, match=f"shard {shards[1].name} named in model.safetensors.index.json is missing"):
        npumoe.load(copy)
    assert shards[1].name in cli_error(capsys, "inspect", str(copy))


def test_integer_tensor_where_a_float_weight_belongs(sharded_bf16, tmp_path, capsys):
    path = sharded_bf16
    copy = tmp_path / "m"
    copy.mkdir()
    state = {}
    for f in path.glob("*.safetensors"):
        state |= load_file(str(f))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.int32)
    save_file(state, str(copy / "model.safetensors"))
    (copy / "config.json").write_bytes((path / "config.json").read_bytes())
    with pytest.raises(WeightError, match=r"'embed\.weight' .* stored as torch\.int32, where a floating-point"):
        npumoe.load(copy)
    assert "floating-point" in cli_error(capsys, "generate", "--model", str(copy), "--ids", "1")


@pytest.mark.parametrize("damage", ["truncated", "header_too_long", "offsets_past_end", "not_json"])
def test_damaged_file_is_named_not_crashed(sharded_bf16, tmp_path, damage):
    path = sharded_bf16
    data = bytearray(sorted(path.glob("*.safetensors"))[0].read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    if damage == "truncated":
        data = data[:-16]
    elif damage == "header_too_long":
        data[:8] = (len(data) + 1).to_bytes(8, "little")
    elif damage == "offsets_past_end":
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"][1] += 4
        blob = json.dumps(header).encode()
        data = bytearray(len(blob).to_bytes(8, "little")) + blob + data[8 + length:]
    else:
        data[8:8 + length] = b"{" * length
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="bad.safetensors is not a readable safetensors file"):
        SafetensorsFile(bad)


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + data


@pytest.mark.parametrize("header, reason", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "tensors 'a' and 'b' overlap"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, "tensors 'a' and 'b' overlap"),
    ({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, "not whole numbers"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}}, "not whole numbers"),
    ({"__metadata__": ["x"], "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "__metadata__"),
])
def test_headers_the_safetensors_library_refuses_are_refused(tmp_path, header, reason):
    """Tensors sharing bytes were read, each from the other's data; the safetensors library itself is the truth
    that these headers are invalid."""
    from safetensors import SafetensorError

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(safetensors_bytes(header, bytes(16)))
    with pytest.raises((SafetensorError, ValueError, TypeError)):  # its own refusal (before or at reading)
        load_file(str(bad))
    with pytest.raises(WeightError, match=f"bad.safetensors is not a readable safetensors file .*{reason}"):
        SafetensorsFile(bad)


def test_a_tensor_in_two_shards_names_both_files(sharded_bf16, tmp_path, capsys):
    """Without an index the later file's copy silently won."""
    copy = tmp_path / "m"
    copy.mkdir()
    for f in sharded_bf16.iterdir():
        if f.name != "model.safetensors.index.json":
            (copy / f.name).write_bytes(f.read_bytes())
    shards = sorted(copy.glob("*.safetensors"))
    state = load_file(str(shards[0]))
    key = sorted(state)[0]
    save_file({key: state[key] + 1}, str(copy / "zz-stale.safetensors"))
    with pytest.raises(WeightError, match=rf"tensor '{key}' is stored in both .*{shards[0].name} and .*"
                                          r"zz-stale\.safetensors; .*remove the stale file"):
        npumoe.load(copy)
    assert "zz-stale.safetensors" in cli_error(capsys, "inspect", str(copy))


def test_a_dangling_weights_symlink_is_named(sharded_bf16, tmp_path, capsys):
    copy = tmp_path / "m"
    copy.mkdir()
    (copy / "config.json").write_bytes((sharded_bf16 / "config.json").read_bytes())
    (copy / "model.safetensors").symlink_to(tmp_path / "moved-away.safetensors")
    with pytest.raises(WeightError, match="model.safetensors is a symbolic link to .*moved-away.safetensors, which "
                                          "does not exist"):
        npumoe.load(copy)
    assert "which does not exist" in cli_error(capsys, "generate", "--model", str(copy), "--ids", "1")


@pytest.mark.parametrize("room_for", [0, 4])  # 0: the header outgrows its room and is written the slow way
def test_streaming_writer_round_trips_through_safetensors(tmp_path, room_for):
    """What the writer streams, the safetensors library reads back bit for bit (it checks the layout)."""
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.uint8),
               "c": torch.randn(2, 2, 2), "empty": torch.zeros(0, 4)}
    writer = SafetensorsWriter(tmp_path / "out.safetensors", tensors=room_for)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.finish({"note": "hi"})
    back = load_file(str(tmp_path / "out.safetensors"))
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    assert SafetensorsFile(tmp_path / "out.safetensors").metadata == {"note": "hi"}
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]  # no temporary left behind
    data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    header_bytes = (tmp_path / "out.safetensors").stat().st_size - data_bytes
    assert (header_bytes == writer._room) == bool(room_for)  # with room: the header filled it, data written once


def test_bench_scale_checkpoint_is_what_transformers_reads(tmp_path):
    """The benchmark's random checkpoint (a real config, shrunk here) is laid out as the Hub stores it:
    transformers loads it without a missing or unexpected key and computes npumoe's logits."""
    from npumoe.bench.scale import OLMOE_1B_7B_0924, write_random_checkpoint

    small = dict(hidden_size=64, intermediate_size=32, num_experts=4, num_hidden_layers=2, vocab_size=300,
                 num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2, eos_token_id=299)
    path = write_random_checkpoint({**OLMOE_1B_7B_0924, **small}, tmp_path / "olmoe", progress=False)
    assert (path / "model.safetensors.index.json").is_file()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = np.arange(1, 12)
    ref, _ = hf_routing(hf.eval(), ids)
    ours = npumoe.Engine(npumoe.load(path, dtype="float32"), chunk=8).forward(ids)
    np.testing.assert_allclose(ours, ref, atol=LOGIT_TOL, rtol=0)


def test_bench_scale_names_a_ckpt_that_is_no_checkpoint_before_running_anything(tmp_path, capsys):
    assert "has no config.json" in cli_error(capsys, "bench", "scale", "--ckpt", str(tmp_path), "--steps", "inspect")
