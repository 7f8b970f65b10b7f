"""``npumoe.load``: a Hugging Face directory (config.json + safetensors) → :class:`Model`, its weights mapped."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from npumoe.core.base.errors import ModelDirError
from npumoe.core.ir.identity import default_mode, weights_fingerprint
from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.weights import Weights
from npumoe.luts.torch_op import fast_compute_dtypes
from npumoe.models.checkpoints.directory import QUANTIZED, canonical_sources, open_checkpoint, weight_files
from npumoe.models.checkpoints.stored_formats import stored_format, views
from npumoe.models.checks import check_config, check_sizes, check_spec
from npumoe.models.demo import DEMO_DIR
from npumoe.models.registry import adapter_for
from npumoe.models.tokenizer import load_tokenizer


@dataclass
class Model:
    spec: ModelSpec
    weights: Weights
    config: dict
    path: Path
    tokenizer: object = field(repr=False, default=None)
    _weights_ids: dict[str, str] = field(repr=False, default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint()

    def weights_fingerprint(self, mode: str | None = None) -> str:
        """The weights' fingerprint (:mod:`npumoe.core.ir.identity`) in ``mode`` (default: the configured one),
        computed on first use: loading reads no data, and most commands never ask."""
        mode = mode or default_mode()
        if mode not in self._weights_ids:
            self._weights_ids[mode] = weights_fingerprint(weight_files(self.path), mode)
        return self._weights_ids[mode]


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory, parsed and checked (:mod:`npumoe.models.checks`)."""
    if path.is_file():
        raise ModelDirError(f"{str(path)!r} is a file, not a model directory; pass the Hugging Face checkpoint "
                            "directory that holds it.")
    if not path.is_dir():
        raise ModelDirError(f"model directory {str(path)!r} does not exist; pass a Hugging Face checkpoint directory.")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(f"{str(path)!r} has no config.json; point --model at a Hugging Face checkpoint directory.")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{cfg_path} is not valid JSON ({err}).") from err
    return check_config(cfg, str(cfg_path))


def config_spec(cfg: dict, where: str = "config.json", checkpoint: Path | None = None):
    """(adapter, ModelSpec) of a checked config, the spec itself checked too, before any weight is touched; with the
    ``checkpoint`` directory, its sizes first checked against the bytes of weights there."""
    if stored := checkpoint is not None and stored_bytes(checkpoint):
        check_sizes(cfg, stored, where)
    adapter = adapter_for(cfg.get("model_type"))
    return adapter, check_spec(adapter.spec(cfg), where)


def stored_bytes(path: Path) -> int:
    """Bytes of the safetensors files in ``path`` (0 when there are none: the weights' own error comes later)."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors") if p.is_file())


def is_gptq(cfg: dict) -> bool:
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "gptq"


def _packed_reader(cfg: dict):
    """read(path, cfg, adapter, spec) → (tensors, packed matrices) for a checkpoint whose routed experts
    load onto the LUT kernels as they are stored, or None for one read as plain tensors."""
    if is_gptq(cfg):  # a Hugging Face GPTQ export: its routed experts are already LUT-ready codes
        from npumoe.models.checkpoints.gptq import read

        return read
    if QUANTIZED in cfg:  # npumoe's own low-bit checkpoint (npumoe quantize)
        from npumoe.models.checkpoints.lut import read

        return lambda path, cfg, adapter, spec: read(path, cfg)
    if stored_format(cfg) == "mxfp4":  # gpt-oss: E2M1 codes are 5-bit LUT codes, packed when first used
        from npumoe.models.checkpoints.mxfp4 import read

        return read
    return None


def _read_weights(path: Path, cfg: dict, adapter, spec: ModelSpec, dtype: str) -> Weights:
    reader = _packed_reader(cfg)
    if reader is None:
        return Weights(canonical_sources(views(open_checkpoint(path), cfg), adapter), spec, source=str(path),
                       dtype=dtype, fast_dtypes=fast_compute_dtypes)
    from npumoe.models.checkpoints.lut import QuantizedWeights

    tensors, packed = reader(path, cfg, adapter, spec)
    return QuantizedWeights(tensors, spec, packed, source=str(path), dtype=dtype, fast_dtypes=fast_compute_dtypes)


def load(path: str | Path | None = None, dtype: str = "auto") -> Model:
    """Load a checkpoint directory (default: the shipped demo model), its weights mapped, not read.

    ``dtype`` is the compute dtype policy of :class:`~npumoe.core.ir.weights.Weights`: ``auto`` (the stored
    bf16 where this CPU's kernels compute from it faster than from fp32; else fp32 when an fp32 copy fits
    comfortably in memory, else the stored dtype), ``float32``, ``bfloat16`` or ``float16``."""
    path = Path(path) if path is not None else DEMO_DIR
    cfg = read_config(path)
    adapter, spec = config_spec(cfg, str(path / "config.json"), path)
    if not is_gptq(cfg):
        stored_format(cfg)  # refuses a quantisation npumoe cannot read, before any work
    weights = _read_weights(path, cfg, adapter, spec, dtype)
    weights.origin = (reopen_weights, (str(path.resolve()), str(weights.dtype).removeprefix("torch.")))
    return Model(spec=spec, weights=weights, config=cfg, path=path, tokenizer=load_tokenizer(path))


@functools.lru_cache(maxsize=2)
def reopen_weights(path: str, dtype: str) -> Weights:
    """A checkpoint's weights mapped in this process, in the compute dtype another process resolved: how
    :class:`Weights` unpickle (a worker lowering many units maps its checkpoint once)."""
    return load(path, dtype=dtype).weights
