"""The Apple GPU through MLX: each IR graph becomes an MLX function (:mod:`.ops`) over its weights as MLX arrays
(:mod:`.weights`), run on the GPU on a Mac and on MLX's CPU backend elsewhere.

An artifact is one safetensors file a graph, its weights as MLX holds them (dense in the model's dtype; luts
codes as MLX's quantised matrices), written by MLX itself; the graph's ops come from the program at load, as
they do for every backend. On disk a layer's prefill and decode graphs each hold its weights; loaded, the graphs
of one artifact directory share one copy of each. An expert group runs as mlx-lm's SwitchGLU runs experts, one
gathered product a projection (:mod:`.switch`); its manifest entry says which way (``experts``). Shapes are the
plan's: MLX has no static-shape rule, but a graph runs at the shapes
it declares, so the engine treats it like any NPU graph (the KV cache passed in, every slot); a decode token whose
graphs are all on mlx runs instead as one MLX graph over a cache kept on the device (:mod:`.step`). Without MLX the
registry says to ``pip install 'npumoe[mlx]'`` (on Linux the extra brings ``mlx[cpu]``: ``mlx`` alone has no
backend there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from npumoe.backends.base import BackendBase
from npumoe.backends.mlx.caps import MLX_CAPS
from npumoe.backends.mlx.ops import graph_function
from npumoe.backends.mlx.step import decode_step
from npumoe.backends.mlx.streams import DEVICES, stream
from npumoe.backends.mlx.switch import execution, gathered_experts
from npumoe.backends.mlx.weights import (
    PRECISIONS,
    QuantizedMatrix,
    dense,
    luts_codes,
    quantized_from_arrays,
    quantized_from_packed,
)
from npumoe.core.base.errors import ArtifactError, BackendUnavailableError, InputError
from npumoe.core.ir.backend import Lowered, check_feed
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph

FORMAT = "mlx-safetensors"
GRAPH_DIR = "graphs"
ACTIVATIONS = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def mlx_device(name: str | None) -> str:
    """``name`` (gpu | cpu; None: MLX's default device), checked against this MLX: one without a GPU backend
    (Linux's mlx[cpu]) refuses the GPU."""
    name = name or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    if name not in DEVICES:
        raise InputError(f"--device {name!r} is not one of {', '.join(DEVICES)} for mlx.")
    if not mx.is_available(DEVICES[name]):
        raise BackendUnavailableError(f"this MLX {mx.__version__} has no {name.upper()} (on Linux it runs on its CPU "
                                      "backend); build with --device cpu, or on a Mac for the GPU.")
    return name


class MlxBackend(BackendBase):
    name = "mlx"
    caps = MLX_CAPS

    def __init__(self, device: str | None = None, precision: str = "stored", activations: str = "float32", **other):
        if other:
            raise InputError(f"--{next(iter(other)).replace('_', '-')} does not apply to mlx; its options are "
                             "--device, --precision and --activations.")
        for option, value, allowed in (("precision", precision, PRECISIONS), ("activations", activations, ACTIVATIONS)):
            if value not in allowed:
                raise InputError(f"--{option} {value!r} is not one of {', '.join(allowed)} for mlx.")
        self.device, self.precision, self.activations = mlx_device(device), precision, activations
        self._loaded: dict[tuple[Path, str], mx.array | QuantizedMatrix] = {}  # graphs of a layer share weights

    def lower(self, graph: Graph, weights, out_dir: Path) -> Lowered:
        arrays, quantized = {}, {}
        for name in graph.weight_names():
            codes = luts_codes(weights, name, graph.kind, self.precision) if _is_matrix(graph, name) else None
            if codes is None:
                arrays[name] = dense(weights[name])
            else:
                arrays |= quantized_from_packed(codes).arrays(name)
                quantized[name] = [codes.meta.bits, codes.meta.group]
        rel = Path(GRAPH_DIR) / f"{graph.name}.safetensors"
        (Path(out_dir) / GRAPH_DIR).mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(Path(out_dir) / rel), arrays)
        del arrays
        mx.clear_cache()  # a graph's arrays are written: MLX need not keep their memory for the next
        info = {"weights": str(rel), "quantized": quantized, "device": self.device, "activations": self.activations}
        if graph.kind == "experts":  # one gathered product a projection, or a product an expert
            gather = self.device == "gpu" or self.activations == "float32"  # (MLX's CPU gather_mm: fp32 only)
            info["experts"] = execution(graph, quantized, gather)
        return Lowered(FORMAT, (str(rel),), info)

    def load(self, artifact: Lowered, out_dir: Path, graph: Graph, weights) -> MlxExecutor:
        if artifact.format != FORMAT:
            raise ArtifactError(f"{out_dir} was not built for mlx; build it with npumoe build --target mlx.")
        device = mlx_device(artifact.info.get("device"))
        quantized = artifact.info.get("quantized", {})
        with mx.stream(stream(device)):
            arrays = mx.load(str(Path(out_dir) / artifact.info["weights"]))  # lazily: only what is read is
            bound = {}
            for name in graph.weight_names():
                key = (Path(out_dir).resolve(), name)  # one artifact directory holds one value a name
                if key not in self._loaded:
                    value = quantized_from_arrays(arrays, name, *quantized[name]) if name in quantized else arrays[name]
                    mx.eval(value.arrays(name) if isinstance(value, QuantizedMatrix) else value)  # read now, not by
                    self._loaded[key] = value  # the first run (on whichever thread that is)
                bound[name] = self._loaded[key]
            gather = artifact.info.get("experts", "").startswith("gather")
            run = gathered_experts(graph, bound) if gather else graph_function(graph, bound, graph.stateless_inputs())
        executor = MlxExecutor(graph, run, device, ACTIVATIONS[artifact.info.get("activations", "float32")], bound)
        executor.gathered = gather
        return executor

    def describe(self) -> dict:
        return {"name": self.name, "mlx": mx.__version__, "device": self.device, "precision": self.precision,
                "activations": self.activations,
                "quantised": "MLX affine, scales and biases fp32 (the luts codes exactly)"}


def _is_matrix(graph: Graph, name: str) -> bool:
    """Is weight ``name`` the matrix of a linear (what may be held quantised), not a bias or norm?"""
    return any(op.op in ("linear", "lut_linear") and op.inputs[1] == WEIGHT_PREFIX + name for op in graph.ops)


class MlxExecutor:
    """One graph as an MLX function: torch tensors in (computed in ``dtype``), fp32 torch tensors out, evaluated on
    its device. A decode step whose graphs are all on mlx runs as one MLX graph instead (``decode_step``)."""

    keeps_state = False
    decode_step = staticmethod(decode_step)
    gathered = False  # an expert group run as gathered products (its ``run`` may be rebound to a step's stacks)

    def __init__(self, graph: Graph, run: Callable[..., list[mx.array]], device: str, dtype: mx.Dtype = mx.float32,
                 weights: Mapping[str, mx.array | QuantizedMatrix] | None = None):
        """``run``: the graph as an MLX function of its stateless inputs, in order, to its outputs; ``weights``:
        what it is bound to."""
        self.graph, self.run, self.device, self.dtype, self.weights = graph, run, device, dtype, weights or {}
        self.inputs = graph.stateless_inputs()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feed(self.graph, inputs, keeps_state=False, static=True)
        with mx.stream(stream(self.device)):
            outputs = self.run(*[mx.array(inputs[name].detach().numpy()).astype(self.dtype) for name in self.inputs])
            mx.eval(outputs)
        return {name: torch.from_numpy(np.array(out.astype(mx.float32)))
                for name, out in zip(self.graph.outputs, outputs)}


__all__ = ["MlxBackend", "MLX_CAPS"]
