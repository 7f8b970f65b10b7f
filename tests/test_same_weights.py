"""At a given precision every target holds the same routed-expert weights: one luts quantisation
(``npumoe.luts.mappings.NPU_INT4``) in the ANE's int4 packages, in the HTP's w4a16 QDQ weights and in
the checkpoint ``npumoe quantize --bits 4 --group 32 --symmetric`` writes for the CPU LUT kernels; the
ANE's palettes are the value tables of ``npumoe quantize --bits 4|2`` (``NPU_PALETTES``); and built
from such a checkpoint, the NPUs take its stored codes. A cross-vendor table then compares devices,
not quantisers."""

import json

import numpy as np
import pytest
import torch
from npu_check import write_texts

import npumoe
from npumoe.cli import main
from npumoe.luts import layout, mappings, spec
from npumoe.luts.torch_op import LutLinear
from npumoe.models.checkpoints.lut import npu_codes
from npumoe.models.checkpoints.quantize import quantize_checkpoint
from npumoe.models.demo import corpus
from npumoe.models.loader import DEMO_DIR

pytest.importorskip("onnxruntime_qnn", reason="the htp target needs onnxruntime-qnn (pip install 'npumoe[htp]')")
pytest.importorskip("coremltools", reason="the ane target needs coremltools (pip install 'npumoe[ane]')")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both vendors at int4, every expert group on the NPU, validated on held-out text."""
    folder = tmp_path_factory.mktemp("int4")
    calibration, heldout = write_texts(folder, heldout_chars=1800)
    main(["build", "--targets", "htp,ane", "--precision", "int4", "--keep-onnx", "--text", str(calibration),
          "--heldout", str(heldout), "--chunk", "32", "--max-context", "512", "--residency", "npu",
          "--graphs-per-layer", "1",  # the weights are the subject, not the shapes
          "--out", str(folder / "build")])
    return folder / "build"


def quantized_demo(folder, fmt: mappings.NpuFormat):
    quantize_checkpoint(DEMO_DIR, folder, bits=fmt.bits, group=fmt.group, symmetric=fmt.symmetric)
    return npumoe.load(folder)


@pytest.fixture(scope="module")
def cpu_checkpoint(tmp_path_factory):
    return quantized_demo(tmp_path_factory.mktemp("int4") / "demo-int4", mappings.NPU_INT4)


def stored_codes(model, name: str) -> spec.Packed:
    return layout.from_tiles(model.weights.packed[name].tiled())


def signed_codes(packed: spec.Packed) -> tuple[np.ndarray, np.ndarray]:
    blocks = mappings.blockwise_shift_scale(packed)
    return blocks.data, blocks.scale


def htp_codes(out) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Expert weight → (signed codes [N, K], fp16 scales [N, K / 32]) from the kept w4a16 ONNX models."""
    import onnx
    from onnx import numpy_helper

    found = {}
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["graphs"].values():
        if entry["precision"] != "w4a16":
            continue
        model = onnx.load(out / entry["onnx"])
        arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "DequantizeLinear" and node.input[0].endswith(".T_quantized"):
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                assert attrs == {"axis": 0, "block_size": mappings.NPU_INT4.group}, node.name
                assert not np.any(arrays[node.input[2]].astype(np.int8)), "int4 zero points must be 0 on the HTP"
                name = node.input[0].removesuffix(".T_quantized")
                found[name] = (arrays[node.input[0]].astype(np.int8).T, arrays[node.input[1]].T.astype(np.float16))
    return found


def ane_arrays(out, op_type: str) -> dict[str, dict[str, np.ndarray]]:
    """Expert weight (as a MIL name) → the arrays of its ``op_type`` constexpr in the experts packages, the
    1×1-conv kernels' trailing dims dropped and a split weight's parts joined. A group's shapes are functions
    holding the same experts: each weight is read from the first function that has it."""
    from npumoe.backends.apple_ane.mil_exec import Package

    found = {}
    manifest = json.loads((out / "manifest.json").read_text())
    for rel in sorted({g["package"] for g in manifest["graphs"].values() if "experts" in g["package"]}):
        package = Package(out / rel)
        for function in package.functions:
            parts: dict[str, list] = {}
            for op in package.operations(function):
                if op.type == op_type:
                    args = {k: np.asarray(package.value(a.arguments[0].value)) for k, a in op.inputs.items()}
                    kernel = op.outputs[0].name.split("_weight_conv")[0] + "_weight"
                    parts.setdefault(kernel, []).append({k: a.reshape(a.shape[:2] + a.shape[4:])
                                                         for k, a in args.items()})
            for kernel, pieces in parts.items():
                found.setdefault(kernel, {a: np.concatenate([p[a] for p in pieces]) for a in pieces[0]})
    return found


def test_every_target_holds_the_same_int4_experts(built, cpu_checkpoint):
    model = npumoe.load()
    experts = sorted(n for n in model.weights if ".experts." in n)
    htp, ane = htp_codes(built / "htp"), ane_arrays(built / "ane", "constexpr_blockwise_shift_scale")
    assert set(htp) == set(experts)
    assert {n.replace(".", "_") for n in experts} == set(ane)
    for name in experts:
        want = signed_codes(mappings.NPU_INT4.quantize(model.weights[name].numpy()))
        arrays = ane[name.replace(".", "_")]
        assert "offset" not in arrays  # symmetric: zero point 0
        ane_codes = (arrays["data"].astype(np.int8), arrays["scale"])
        for target, (codes, scales) in {"htp": htp[name], "ane": ane_codes,
                                        "cpu": signed_codes(stored_codes(cpu_checkpoint, name))}.items():
            np.testing.assert_array_equal(codes, want[0], err_msg=f"{target} {name} codes")
            np.testing.assert_array_equal(scales, want[1], err_msg=f"{target} {name} scales")


@pytest.mark.parametrize("precision, bits", [("palettize4", 4), ("palettize2", 2)])
def test_ane_palettes_are_the_cpu_checkpoints_value_tables(precision, bits, tmp_path):
    """palettize4/2 hold the codes of npumoe quantize --bits 4|2 (group 64) as indices and each group's value
    table as its palette; a layer-0 build is enough to read them."""
    from npumoe.core.compiler.artifacts import build
    from npumoe.core.planning.plan import plan
    from npumoe.core.runtime.calibrate import calibrate

    model, fmt = npumoe.load(), mappings.NPU_PALETTES[bits]
    cpu = quantized_demo(tmp_path / "cpu", fmt)
    ane_plan = plan(model, calibrate(model, [corpus.calibration_texts(1)[0][:1500]], chunk=16), target="ane",
                    residency="npu", graphs_per_layer=1)
    build(model, ane_plan, "ane", tmp_path / "ane", max_context=64, progress=False, precision=precision, layers={0})
    palettes = ane_arrays(tmp_path / "ane", "constexpr_lut_to_dense")
    layer0 = sorted(n for n in model.weights if n.startswith("layers.0.") and ".experts." in n)
    assert {n.replace(".", "_") for n in layer0} == set(palettes)
    for name in layer0:
        want = mappings.lut_to_dense(stored_codes(cpu, name))
        np.testing.assert_array_equal(palettes[name.replace(".", "_")]["indices"], want.indices, err_msg=name)
        np.testing.assert_array_equal(palettes[name.replace(".", "_")]["lut"], want.lut, err_msg=name)


def test_htp_w4a16_agrees_with_fp32_on_held_out_text(built):
    """All expert groups on the HTP at int4: ≥ 95 % top-1 agreement (the issue's bar)."""
    validation = json.loads((built / "manifest.json").read_text())["targets"]["htp"]["validation"]
    assert validation["top1_agreement"] >= 0.95 and validation["cosine"] > 0.999, validation
    assert validation["tokens"] >= 400


def test_a_quantized_checkpoints_codes_are_what_the_npus_take(cpu_checkpoint):
    """From an npumoe-quantised checkpoint the NPU builds take its stored codes (the CPU's), not a
    requantisation of their values, which differs where a group's fp16 scale is subnormal."""
    weights = cpu_checkpoint.weights
    name = next(n for n in weights.packed if ".experts." in n)
    assert np.array_equal(spec.unpack(npu_codes(weights, name, mappings.NPU_INT4)),
                          spec.unpack(stored_codes(cpu_checkpoint, name)))

    tiny = mappings.NPU_INT4.quantize(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32) * 1e-6)
    values = spec.dequantize(tiny)
    assert not np.array_equal(spec.unpack(mappings.NPU_INT4.quantize(values)), spec.unpack(tiny))  # other codes

    class Quantized(dict):  # what a quantised checkpoint's weights offer: packed linears, and their values
        packed = {"w": LutLinear(tiny)}

    assert np.array_equal(spec.unpack(npu_codes(Quantized(w=torch.from_numpy(values)), "w", mappings.NPU_INT4)),
                          spec.unpack(tiny))
