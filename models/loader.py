"""``npumoe.load``: a Hugging Face directory (config.json + safetensors) → :class:`Model`.

Only safetensors are read. Pickle checkpoints (.bin, .pt, .pth) can run arbitrary code
when loaded, so npumoe refuses them and says how to convert.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from npumoe.core.identity import default_mode, weights_fingerprint
from npumoe.core.spec import ModelSpec
from npumoe.core.tensorfile import Checkpoint
from npumoe.core.weights import TensorSource, Weights
from npumoe.models.checks import check_config, check_spec
from npumoe.models.registry import adapter_for
from npumoe.models.stored_formats import StoredView, plain_views, stored_format, views
from npumoe.models.tokenizer import load_tokenizer

from npumoe.errors import ModelDirError, WeightError

DEMO_DIR = Path(__file__).parent / "demo"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
QUANTIZED = "npumoe_quantization"  # config.json section of npumoe.luts.checkpoint


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
        """The weights' fingerprint (:mod:`npumoe.core.identity`) in ``mode`` (default: the configured one),
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


def config_spec(cfg: dict, where: str = "config.json"):
    """(adapter, ModelSpec) of a checked config, the spec itself checked too, before any weight is touched."""
    adapter = adapter_for(cfg.get("model_type"))
    return adapter, check_spec(adapter.spec(cfg), where)


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise WeightError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}); npumoe never unpickles weights. "
            "Convert them to safetensors first (e.g. save_pretrained(..., safe_serialization=True))."
        )
    raise WeightError(f"{path} has no *.safetensors weights.")


def open_checkpoint(path: Path) -> Checkpoint:
    """The directory's safetensors, mapped (headers read and checked, no tensor data)."""
    return Checkpoint.open(path, safetensors_files(path))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files the checkpoint is read from (through its index when it has one)."""
    return [f.path for f in open_checkpoint(path).files.values()]


def stored_tensors(path: Path):
    """(name as stored, mapped tensor) for every tensor in the directory's safetensors files."""
    ckpt = open_checkpoint(path)
    for key in ckpt.entries:
        yield key, ckpt.tensor(key)


def canonical_sources(views: list[StoredView], adapter) -> dict[str, TensorSource]:
    """Canonical name → where to read it. The adapter's rules run on shape-only (meta) tensors
    here and on the stored tensor when one is read; an expert of a stacked tensor is read alone
    (a view of it, or for a compressed format only its expert widened)."""
    sources: dict[str, TensorSource] = {}
    for view in views:
        shaped = torch.empty(view.shape, dtype=view.dtype, device="meta")
        for name, t in adapter.canonical(view.key, shaped):
            expert = EXPERT.search(name)
            read = partial(_read_canonical, view, adapter, name)
            if expert and view.read_expert is not None and not EXPERT.search(view.key):  # one of a stack
                read = partial(_read_stacked_expert, view, adapter, name, int(expert.group(1)))
            sources[name] = TensorSource(tuple(t.shape), view.dtype, read)
    return sources


EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _read_canonical(view: StoredView, adapter, name: str) -> torch.Tensor:
    return dict(adapter.canonical(view.key, view.read()))[name]


def _read_stacked_expert(view: StoredView, adapter, name: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s tensor from a stack of one: the adapter names it expert 0."""
    return dict(adapter.canonical(view.key, view.read_expert(expert)))[EXPERT.sub(".experts.0.", name, count=1)]


def read_tensors(path: Path, adapter) -> dict[str, torch.Tensor]:
    """Every canonical tensor of a plain checkpoint, read (mapped views where the stored layout allows)."""
    return {name: src.read() for name, src in canonical_sources(plain_views(open_checkpoint(path)), adapter).items()}


def is_gptq(cfg: dict) -> bool:
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "gptq"


def _packed_reader(cfg: dict):
    """read(path, cfg, adapter, spec) → (tensors, packed matrices) for a checkpoint whose routed experts
    load onto the LUT kernels as they are stored, or None for one read as plain tensors."""
    if is_gptq(cfg):  # a Hugging Face GPTQ export: its routed experts are already LUT-ready codes
        from npumoe.luts.gptq_checkpoint import read

        return read
    if QUANTIZED in cfg:  # npumoe's own low-bit checkpoint (npumoe quantize)
        from npumoe.luts.checkpoint import read

        return lambda path, cfg, adapter, spec: read(path, cfg)
    if stored_format(cfg) == "mxfp4":  # gpt-oss: E2M1 codes are 5-bit LUT codes, packed when first used
        from npumoe.luts.mxfp4_checkpoint import read

        return read
    return None


def _read_weights(path: Path, cfg: dict, adapter, spec: ModelSpec, dtype: str) -> Weights:
    reader = _packed_reader(cfg)
    if reader is None:
        return Weights(canonical_sources(views(open_checkpoint(path), cfg), adapter), spec, source=str(path),
                       dtype=dtype)
    from npumoe.luts.checkpoint import QuantizedWeights

    tensors, packed = reader(path, cfg, adapter, spec)
    return QuantizedWeights(tensors, spec, packed, source=str(path), dtype=dtype)


def load(path: str | Path | None = None, dtype: str = "auto") -> Model:
    """Load a checkpoint directory (default: the shipped demo model), its weights mapped, not read.

    ``dtype`` is the compute dtype policy of :class:`~npumoe.core.weights.Weights`: ``auto`` (fp32
    when an fp32 copy fits comfortably in memory, else the stored dtype), ``float32``, ``bfloat16``
    or ``float16``."""
    path = Path(path) if path is not None else DEMO_DIR
    cfg = read_config(path)
    adapter, spec = config_spec(cfg, str(path / "config.json"))
    if not is_gptq(cfg):
        stored_format(cfg)  # refuses a quantisation npumoe cannot read, before any work
    weights = _read_weights(path, cfg, adapter, spec, dtype)
    return Model(spec=spec, weights=weights, config=cfg, path=path, tokenizer=load_tokenizer(path))
