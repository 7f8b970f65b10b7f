"""Quantised checkpoints: a model directory whose routed-expert matrices are stored packed.

What ``npumoe quantize`` writes and ``npumoe.load`` reads:

    config.json        the source's, plus ``"npumoe_quantization": {format, version, bits, group,
                       symmetric, weights}``. npumoe's own key: ``quantization_config`` names
                       foreign formats (GPTQ, AWQ, FP8), which the loader refuses.
    model.safetensors  every tensor under its canonical name (:mod:`npumoe.core.ir.weights`), not
                       the Hugging Face one, so no adapter has to map it back. A quantised matrix
                       NAME is stored in the kernels' tiled layout (:mod:`npumoe.luts.layout`) as
                       ``NAME.tiles`` (on a 64-byte boundary) / ``NAME.scales`` / ``NAME.zeros``
                       (absent for symmetric weights) and described in the header metadata
                       ``"npumoe.luts"``: {NAME: {bits, group, symmetric, shape, checksum}}; the
                       checksum (:func:`~npumoe.luts.layout.tiles_checksum`) is checked on load, so a
                       corrupted tile is an error, not noise. Other tensors keep their stored dtype.
    anything else      (tokenizer files, generation config) copied as is.

On load a packed matrix stays packed (:class:`QuantizedWeights`), its tiles views of the mapped file
(nothing is re-tiled or copied, so the pages are the page cache's): the CPU executor runs it
through ``npumoe::lut_linear``, and a backend that lowers fp32 weights gets it dequantised
when it asks for it, so a loaded model holds its experts at their packed size. Foreign formats
whose codes are LUT codes too load through the same class: GPTQ exports packed at load, gpt-oss
MXFP4 experts packed when first used (:class:`Deferred`). Version 1 checkpoints stored the bit planes
(:class:`npumoe.luts.spec.Packed`'s arrays), re-tiled in private memory at load; they still load.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.errors import WeightError
from npumoe.core.ir.spec import ModelSpec, MoESpec
from npumoe.core.ir.tensorfile import SafetensorsFile
from npumoe.core.ir.weights import TensorSource, Weights, expected_shapes, expert, tensor_digest
from npumoe.luts import layout, mappings, spec
from npumoe.luts.torch_op import LutLinear
from npumoe.models.checkpoints import LINEARS
from npumoe.models.checkpoints.directory import QUANTIZED as SECTION

FORMAT, VERSION = "npumoe-luts", 2
WEIGHTS_FILE = "model.safetensors"
METADATA_KEY = "npumoe.luts"
PARTS = ("tiles", "scales", "zeros")  # a TiledWeight's arrays
PLANES_VERSION, PLANES_PARTS = 1, ("planes", "scales", "zeros")  # spec.Packed's arrays, re-tiled at load
TILES_ALIGN = 64  # a cache line: the kernels stream tiles 64 bytes at a time


HEAD = "lm_head.weight"


def quantized_names(model_spec: ModelSpec, linears: str = "experts") -> list[str]:
    """The matrices a checkpoint stores packed: every routed expert's gate, up and down; with ``linears="all"``
    also attention projections, dense and shared FFNs and the LM head. Routers stay as stored (their top-k
    picks the experts, and they are a small share of the bytes), so does the embedding (a row gather)."""
    routed = [f"{expert(i, e)}.{proj}.weight"
              for i, layer in enumerate(model_spec.layers) if isinstance(layer.ffn, MoESpec)
              for e in range(layer.ffn.num_experts) for proj in ("gate", "up", "down")]
    if linears == "experts":
        return routed
    others = [name for name, shape in expected_shapes(model_spec).items()
              if len(shape) == 2 and name.endswith(".weight") and name != "embed.weight" and ".router." not in name]
    return routed + sorted(set(others) - set(routed))


def section(bits: int, group: int, symmetric: bool, linears: str = "experts", head_bits: int | None = None) -> dict:
    weights = LINEARS[linears] + (f", the LM head at {head_bits} bits" if head_bits not in (None, bits) else "")
    return {"format": FORMAT, "version": VERSION, "bits": bits, "group": group, "symmetric": symmetric,
            "weights": weights}


def stored_parts(tiled: layout.TiledWeight) -> list[tuple[str, np.ndarray]]:
    """The tensors a packed matrix is stored as (suffix, array), in file order."""
    return [(part, a) for part in PARTS if (a := getattr(tiled, part)) is not None]


def read(path: Path, cfg: dict) -> tuple[dict[str, torch.Tensor], dict[str, spec.Packed | layout.TiledWeight]]:
    """(plain tensors, packed matrices) of a checkpoint."""
    info = cfg[SECTION]
    if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("version") not in (PLANES_VERSION,
                                                                                                 VERSION):
        raise WeightError(f"{path}/config.json has an {SECTION} section npumoe {VERSION} cannot read ({info!r}); "
                          "re-quantise the original model with this version of npumoe quantize.")
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise WeightError(f"{path} is an npumoe-quantised checkpoint without its {WEIGHTS_FILE}; "
                          "re-run npumoe quantize.")
    mapped = SafetensorsFile(file)
    stored = {key: mapped.tensor(key) for key in mapped.entries}
    try:
        meta = json.loads(mapped.metadata.get(METADATA_KEY, "null"))
    except json.JSONDecodeError as err:
        raise WeightError(f"{file} is not a readable npumoe-quantised safetensors file ({err}); re-run npumoe "
                          "quantize.") from err
    if not isinstance(meta, dict):
        raise WeightError(f"{file} lacks its {METADATA_KEY!r} metadata, so its packed tensors cannot be checked; "
                          "re-run npumoe quantize.")
    entry = _tiled if info["version"] == VERSION else _planes
    return stored, {name: entry(name, m, stored, file) for name, m in meta.items()}


def _tiled(name: str, meta: dict, stored: dict, file: Path) -> layout.TiledWeight:
    """A packed matrix as views of the mapped file, its checksum read in place."""
    try:
        symmetric = meta["symmetric"]
        arrays = {part: stored.pop(f"{name}.{part}").numpy() for part in PARTS if not (part == "zeros" and symmetric)}
        tiled = layout.TiledWeight(meta["bits"], meta["group"], tuple(meta["shape"]), arrays["tiles"],
                                   arrays["scales"], arrays.get("zeros"))
        expected = meta["checksum"]
    except (KeyError, TypeError) as err:
        raise WeightError(f"{file} describes a packed {name!r} but lacks its {err} entry; re-run npumoe "
                          "quantize.") from err
    tiled.check(fix="re-run npumoe quantize")
    if layout.tiles_checksum(tiled) != expected:
        raise WeightError(f"{file}: {name!r} fails its checksum (expected {expected}): the file was altered or "
                          "corrupted; re-run npumoe quantize.")
    return tiled


def _planes(name: str, meta: dict, stored: dict, file: Path) -> spec.Packed:
    try:
        m = spec.PackedMeta(meta["bits"], meta["group"], meta["symmetric"], tuple(meta["shape"]), meta["checksum"])
        arrays = [stored.pop(f"{name}.{part}").numpy() for part in PLANES_PARTS]
    except (KeyError, TypeError) as err:
        raise WeightError(f"{file} describes a packed {name!r} but lacks its {err} entry; re-run npumoe "
                          "quantize.") from err
    packed = spec.Packed(m, *arrays)
    spec.verify(packed)
    return packed


@dataclass(frozen=True)
class Deferred:
    """A matrix to be held packed only if it can be, decided and packed when first needed.

    A checkpoint whose codes need converting (MXFP4's) would otherwise read every expert at load,
    minutes for gpt-oss-120b, where ``inspect`` and ``plan`` read headers only. ``packable`` is
    the cheap check (MXFP4: its scales fit float16), ``build`` the packing; a matrix that is not
    packable stays with its plain source, which the weights must also be given.
    """

    bits: int
    group: int
    packable: Callable[[], bool]
    build: Callable[[], spec.Packed]


class PackedLinears(Mapping):
    """Matrix name → :class:`LutLinear`, for the matrices held packed; a deferred one is checked and
    built when first asked about, then kept (the executor binds each once, as it would a tensor)."""

    def __init__(self, entries: Mapping[str, spec.Packed | layout.TiledWeight | Deferred]):
        self._entries = dict(entries)
        self._packable: dict[str, bool] = {}
        self._linears = {name: LutLinear(p) for name, p in entries.items() if not isinstance(p, Deferred)}

    def __contains__(self, name) -> bool:
        entry = self._entries.get(name)
        if not isinstance(entry, Deferred):
            return entry is not None
        if name not in self._packable:
            self._packable[name] = entry.packable()
        return self._packable[name]

    def __getitem__(self, name: str) -> LutLinear:
        if name not in self:
            raise KeyError(name)
        if name not in self._linears:
            self._linears[name] = LutLinear(self._entries[name].build())
        return self._linears[name]

    def __iter__(self):
        return (name for name in self._entries if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def candidates(self) -> list[str]:
        """Every matrix offered packed, including those that stay plain (not packable)."""
        return list(self._entries)

    @property
    def formats(self) -> list[tuple[int, int]]:
        """(bits, group) of the matrices held packed, without packing a deferred one."""
        return sorted({(e.meta.bits, e.meta.group) if isinstance(e, spec.Packed) else (e.bits, e.group)
                       for name, e in self._entries.items() if name in self})


class QuantizedWeights(Weights):
    """Weights some of whose matrices are held only packed.

    ``packed[name]`` is the :class:`LutLinear` the CPU executor runs instead of an fp32
    ``linear``; ``self[name]`` dequantises it on each access (bit-identical to
    :func:`npumoe.luts.spec.dequantize`), for backends that lower fp32 weights once.
    A :class:`Deferred` matrix keeps its plain source in ``tensors`` for when it is not packable.
    """

    def __init__(self, tensors: Mapping[str, TensorSource | torch.Tensor], model_spec: ModelSpec,
                 packed: Mapping[str, spec.Packed | layout.TiledWeight | Deferred], source: str = "",
                 dtype: str | torch.dtype = "float32", fast_dtypes=None):
        shapes = {name: torch.empty(p.meta.shape if isinstance(p, spec.Packed) else p.shape, device="meta")
                  for name, p in packed.items() if not isinstance(p, Deferred)}
        super().__init__(dict(tensors) | shapes, model_spec, source, dtype, fast_dtypes)
        self.packed = PackedLinears(packed)

    def digest(self, names) -> str:
        """Packed matrices are hashed by their packed arrays (their shape source holds no data)."""
        plain = [n for n in names if n not in self.packed]
        h = hashlib.blake2b(super().digest(plain).encode(), digest_size=16)
        for name in (n for n in names if n in self.packed):
            h.update(name.encode())
            for buffer in self.packed[name].buffers():
                tensor_digest(h, buffer)
        return h.hexdigest()

    @property
    def stored_dtypes(self) -> dict[torch.dtype, int]:
        """Parameters per stored dtype, of the tensors not held packed."""
        counts: dict[torch.dtype, int] = {}
        for name in self:
            if name not in self.packed:
                src = self.source(name)
                counts[src.dtype] = counts.get(src.dtype, 0) + math.prod(src.shape)
        return counts

    def __getitem__(self, name: str) -> torch.Tensor:
        linear = self.packed.get(name)
        return super().__getitem__(name) if linear is None else linear.dequantized()


def npu_codes(weights: Mapping[str, torch.Tensor], name: str, fmt: mappings.NpuFormat) -> spec.Packed:
    """The codes an NPU build holds for matrix ``name`` in ``fmt``: the checkpoint's own when it stores them
    in that format (what the CPU LUT kernels run), else ``fmt.quantize`` of the weight. ANE and HTP builds
    both ask here, so every target holds the same codes and scales."""
    packed = getattr(weights, "packed", {})
    if name in packed:
        tiled = packed[name].tiled()
        if (tiled.bits, tiled.group, tiled.zeros is None) == (fmt.bits, fmt.group, fmt.symmetric):
            return layout.from_tiles(tiled)
    return fmt.quantize(weights[name].detach().float().numpy())
