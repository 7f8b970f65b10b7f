"""``npumoe.load``: a Hugging Face directory (config.json + safetensors) → :class:`Model`.

Only safetensors are read. Pickle checkpoints (.bin, .pt, .pth) can run arbitrary code
when loaded, so npumoe refuses them and says how to convert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from npumoe.core.spec import ModelSpec
from npumoe.core.weights import Weights
from npumoe.models.registry import adapter_for
from npumoe.models.tokenizer import load_tokenizer
from safetensors import SafetensorError, safe_open

from npumoe.errors import ModelDirError, UnsupportedModelError, WeightError

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

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint()


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelDirError(f"model directory {str(path)!r} does not exist; pass a Hugging Face checkpoint directory.")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(f"{str(path)!r} has no config.json; point --model at a Hugging Face checkpoint directory.")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{cfg_path} is not valid JSON ({err}).") from err


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


def stored_tensors(path: Path):
    """(name as stored, tensor) for every tensor in the directory's safetensors files."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except SafetensorError as err:
            raise WeightError(f"{file.name} is not a readable safetensors file ({err}).") from err


def read_tensors(path: Path, adapter) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in stored_tensors(path):
        tensors.update(adapter.canonical(key, tensor))
    return tensors


def refuse_quantized(cfg: dict) -> None:
    """Quantized checkpoints other than GPTQ (FP8 DeepSeek-V3, MXFP4 gpt-oss, AWQ, ...) store
    scales beside their weights; reading the weights alone would be a silent wrong answer."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "an unknown method") if isinstance(quant, dict) else quant
        raise UnsupportedModelError(
            f"this checkpoint is quantized ({method}); npumoe reads unquantized bf16/fp16/fp32 weights and "
            "GPTQ exports, so use a dequantized copy of the model."
        )


def is_gptq(cfg: dict) -> bool:
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "gptq"


def _read_weights(path: Path, cfg: dict, adapter, spec: ModelSpec) -> Weights:
    if is_gptq(cfg):  # a Hugging Face GPTQ export: its routed experts are already LUT-ready codes
        from npumoe.luts.checkpoint import QuantizedWeights
        from npumoe.luts.gptq_checkpoint import read

        tensors, packed = read(path, cfg, adapter, spec)
        return QuantizedWeights(tensors, spec, packed, source=str(path))
    if QUANTIZED in cfg:  # npumoe's own low-bit checkpoint (npumoe quantize)
        from npumoe.luts.checkpoint import QuantizedWeights, read

        tensors, packed = read(path, cfg)
        return QuantizedWeights(tensors, spec, packed, source=str(path))
    return Weights(read_tensors(path, adapter), spec, source=str(path))


def load(path: str | Path | None = None) -> Model:
    """Load a checkpoint directory (default: the shipped demo model)."""
    path = Path(path) if path is not None else DEMO_DIR
    cfg = read_config(path)
    adapter = adapter_for(cfg.get("model_type"))
    if not is_gptq(cfg):
        refuse_quantized(cfg)
    spec = adapter.spec(cfg)
    weights = _read_weights(path, cfg, adapter, spec)
    return Model(spec=spec, weights=weights, config=cfg, path=path, tokenizer=load_tokenizer(path))
