"""Hugging Face GPTQ checkpoints, loaded as they are stored.

A GPTQ checkpoint (``quantization_config.quant_method == "gptq"``, as AutoGPTQ, GPTQModel
and optimum write it) stores each quantised linear X as ``X.qweight`` / ``X.qzeros`` /
``X.scales`` (and ``X.g_idx``, ``X.bias``). Its codes, scales and zero points are npumoe's
(:func:`npumoe.luts.gptq.from_gptq`), so routed experts load packed, straight into the LUT
kernels, with no second rounding; the other quantised linears (attention, shared experts,
dense MLPs) are dequantised to fp32, which is what the backends lower.
"""

from __future__ import annotations

from pathlib import Path

import torch

from npumoe.core.base.errors import InputError, UnsupportedModelError, WeightError
from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.weights import expected_shapes
from npumoe.luts import gptq, spec
from npumoe.models.checkpoints.lut import quantized_names

PARTS = ("qweight", "qzeros", "scales", "g_idx", "bias")
FORMATS = {"gptq": "v1", "gptq_v2": "v2"}  # checkpoint_format → zero-point convention
GPTQ_BITS = (2, 3, 4, 8)  # what GPTQ exporters write (and its int32 packing was checked for)


def options(cfg: dict, path: Path) -> tuple[int, int, str]:
    """(bits, group, zero-point convention) of a GPTQ config, or a clear refusal."""
    quant = cfg["quantization_config"]
    bits, group = quant.get("bits"), quant.get("group_size")
    if group is None or group <= 0:
        raise UnsupportedModelError(f"{path} is GPTQ with one scale per output row (group_size {group}); npumoe's "
                                    "LUT format needs groups of 32, 64 or 128 inputs: use a grouped GPTQ export.")
    try:
        if bits not in GPTQ_BITS:
            raise InputError(f"GPTQ exports hold {', '.join(map(str, GPTQ_BITS))} bits.")
        spec.check_format(bits, group)
    except InputError as err:
        raise UnsupportedModelError(f"{path} is GPTQ at {bits} bits, group {group}, which npumoe cannot hold: "
                                    f"{err}") from err
    version = FORMATS.get(quant.get("checkpoint_format", "gptq"))
    if version is None:
        raise UnsupportedModelError(f"{path} has GPTQ checkpoint_format {quant['checkpoint_format']!r}; npumoe reads "
                                    f"{' and '.join(FORMATS)}.")
    return bits, group, version


def read(path: Path, cfg: dict, adapter,
         model_spec: ModelSpec) -> tuple[dict[str, torch.Tensor], dict[str, spec.Packed]]:
    """(plain tensors, packed routed experts) of a GPTQ checkpoint, under canonical names."""
    from npumoe.models.checkpoints.directory import stored_tensors

    bits, group, version = options(cfg, path)
    stored = dict(stored_tensors(path))
    routed, wanted = set(quantized_names(model_spec)), expected_shapes(model_spec)
    tensors, packed = {}, {}
    for prefix in [key[: -len(".qweight")] for key in stored if key.endswith(".qweight")]:
        parts = {part: stored.pop(f"{prefix}.{part}", None) for part in PARTS}
        matrix = _packed(prefix, parts, bits, group, version, path)
        name = _canonical_name(adapter, prefix, matrix.meta.shape, path)
        if name in routed:
            packed[name] = matrix
        else:
            tensors[name] = torch.from_numpy(spec.dequantize(matrix))
        if parts["bias"] is not None:
            tensors |= _bias(adapter, prefix, parts["bias"], wanted, path)
    for key, tensor in stored.items():
        tensors.update(adapter.canonical(key, tensor))
    return tensors, packed


def _packed(prefix: str, parts: dict, bits: int, group: int, version: str, path: Path) -> spec.Packed:
    missing = [part for part in ("qzeros", "scales") if parts[part] is None]
    if missing:
        raise WeightError(f"{path}: GPTQ layer {prefix} has a qweight but no {missing[0]}; the checkpoint is "
                          "incomplete.")
    try:
        return gptq.from_gptq(*(_numpy(parts[p]) for p in ("qweight", "qzeros", "scales")), bits, group,
                              None if parts["g_idx"] is None else _numpy(parts["g_idx"]), version)
    except WeightError as err:
        raise WeightError(f"{path}: GPTQ layer {prefix}: {err}") from err


def _numpy(tensor: torch.Tensor):
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()  # numpy has no bfloat16


def _canonical_name(adapter, prefix: str, shape: tuple[int, int], path: Path) -> str:
    names = [name for name, _ in adapter.canonical(f"{prefix}.weight", torch.empty(shape, device="meta"))]
    if len(names) != 1:
        raise UnsupportedModelError(f"{path}: GPTQ layer {prefix} is not a linear layer npumoe knows for this "
                                    "model type, so its quantised weight has nowhere to go.")
    return names[0]


def _bias(adapter, prefix: str, bias: torch.Tensor, wanted: dict, path: Path) -> dict[str, torch.Tensor]:
    """The layer's bias, if the model has one there; GPTQ exporters also save all-zero ones it lacks."""
    mapped = dict(adapter.canonical(f"{prefix}.bias", bias))
    extra = {name: t for name, t in mapped.items() if name not in wanted}
    if any(bool(torch.any(t != 0)) for t in extra.values()):
        raise UnsupportedModelError(f"{path}: GPTQ layer {prefix} stores a non-zero bias that this model type does "
                                    "not have; its config.json and weights disagree.")
    return {name: t for name, t in mapped.items() if name in wanted}
