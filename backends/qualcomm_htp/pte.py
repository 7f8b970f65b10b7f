"""``--via executorch``: the same IR graphs lowered by ExecuTorch's QNN partitioner to ``.pte`` and run
by ExecuTorch's runtime on the HTP (through :mod:`.shim` here).

Each graph becomes a torch module that runs the reference executor's op implementations
(so its semantics are the IR's by construction) with the weights as buffers, exported with
static shapes. One exception: RMSNorm divides by the root mean square, because the QNN
lowering of the rsqrt form is wrong over [S, heads, D]. ``fp16`` lowers in fp16; ``w8a16`` is
ExecuTorch's QnnQuantizer 16a8w (16-bit activations, 8-bit weights), calibrated on the same feeds
as the ONNX path. Ops the partitioner does not take stay on ExecuTorch's portable CPU kernels.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.core.compiler.interpreter import OP_IMPLS
from npumoe.core.ir.backend import check_feed
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph

PRECISIONS = ("fp16", "w8a16")


def _rmsnorm_div(x, w, *, eps):
    """RMSNorm as a division: ExecuTorch's QNN lowering of the rsqrt form over [S, heads, D] (qk-norm)
    normalises wrongly (cosine 0.71 at [16, 2, 32])."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


IMPLS = {**OP_IMPLS, "rmsnorm": _rmsnorm_div}


class IrModule(torch.nn.Module):
    """One IR graph as a module: inputs in the graph's input order, outputs as a tuple in output order."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.graph = graph
        self.buffer_of = {n: re.sub(r"\W", "_", n) for n in graph.weight_names()}
        for name, buf in self.buffer_of.items():
            self.register_buffer(buf, weights[name].detach().float().clone())

    def forward(self, *inputs):
        env = dict(zip(self.graph.stateless_inputs(), inputs))
        for op in self.graph.ops:
            args = [getattr(self, self.buffer_of[v[len(WEIGHT_PREFIX):]]) if v.startswith(WEIGHT_PREFIX) else env[v]
                    for v in op.inputs]
            env[op.outputs[0]] = IMPLS[op.op](*args, **op.a)
        return tuple(env[name] for name in self.graph.outputs)


def _executorch():
    from npumoe.backends.qualcomm_htp.shim import qnn_sdk_root

    qnn_sdk_root()
    try:
        from executorch.backends.qualcomm.utils import utils
    except ImportError as err:
        raise BackendUnavailableError(f"--via executorch needs executorch ({err}); install it with "
                                      "pip install executorch==1.5.1.") from err
    return utils


def save_pte(graph: Graph, weights, path: Path, precision: str, chipset: str, samples=None) -> None:
    if precision not in PRECISIONS:
        raise InputError(f"--via executorch takes --precision {' or '.join(PRECISIONS)} (QnnQuantizer 16a8w), "
                         f"not {precision!r}.")
    utils = _executorch()
    module = IrModule(graph, weights).eval()
    example = tuple(torch.zeros(graph.inputs[n].shape) for n in graph.stateless_inputs())
    if precision == "w8a16":
        module = _quantized(module, example, samples)
    specs = utils.generate_qnn_executorch_compiler_spec(
        soc_model=utils.get_soc_to_chipset_map()[chipset],
        backend_options=utils.generate_htp_compiler_spec(use_fp16=precision == "fp16"))
    program = utils.to_edge_transform_and_lower_to_qnn(module, example, specs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(program.to_executorch().buffer)


def _quantized(module, example, samples):
    from executorch.backends.qualcomm.quantizer.quantizer import (
        QnnQuantizer,
        QuantDtype,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(QuantDtype.use_16a8w)
    prepared = prepare_pt2e(torch.export.export(module, example, strict=False).module(), quantizer)
    for feed in samples:
        prepared(*(torch.from_numpy(feed[n]) for n in module.graph.stateless_inputs()))
    return convert_pt2e(prepared)


class PteExecutor:
    """One graph's ``.pte`` on ExecuTorch's runtime: IR tensors in, IR tensors out."""

    keeps_state = False

    def __init__(self, path: Path, graph: Graph):
        from executorch.runtime import Runtime

        from npumoe.backends.qualcomm_htp.executor import encode

        _executorch()
        self.graph, self._encode = graph, encode
        self.method = Runtime.get().load_program(str(path)).load_method("forward")

    def __call__(self, inputs):
        check_feed(self.graph, inputs, keeps_state=False, static=True)
        feed = self._encode(self.graph, inputs)
        outs = self.method.execute([torch.from_numpy(np.ascontiguousarray(feed[n])) for n in feed])
        return {name: out.detach().float() for name, out in zip(self.graph.outputs, outs)}
