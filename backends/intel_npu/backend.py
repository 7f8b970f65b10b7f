"""Intel's NPU through OpenVINO: IR graph → standard ONNX (:mod:`npumoe.backends.onnx_export`) →
OpenVINO IR (``.xml`` + ``.bin``, weights compressed to fp16, the NPU's compute precision) → a
compiled model per graph, static shapes, the KV cache passed in as inputs like the HTP's.

Written by following docs/porting.md: a registry record (:mod:`.caps`), ``lower`` and ``load``; build, the
build cache and ``--jobs`` come from :class:`~npumoe.backends.base.BackendBase`. OpenVINO's ``NPU``
device needs the hardware and its driver; without one the same IR runs on OpenVINO's ``CPU`` device,
which the manifest and every executor say.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import torch

from npumoe.backends.base import BackendBase
from npumoe.backends.intel_npu.caps import INTEL_NPU_CAPS
from npumoe.core.base.errors import ArtifactError, BackendUnavailableError, InputError
from npumoe.core.base.machine import available_memory, physical_memory
from npumoe.core.ir.backend import DeviceMemoryFull, Lowered, check_feed
from npumoe.core.ir.graph import Role

FORMAT = "openvino-ir"
GRAPH_DIR = "graphs"
DEVICES = ("NPU", "CPU", "AUTO")
# Host memory the CPU device leaves free beside its graphs, for the engine and the rest of the machine: half of it
HOST_SPARE = max(4 << 30, physical_memory() // 2)
MASK_FLOOR = -1e4  # −inf does not survive fp16 arithmetic; exp(−10⁴) is 0 in every precision


def openvino():
    try:
        import openvino as ov
    except ImportError as err:
        raise BackendUnavailableError(f"the Intel NPU backend needs OpenVINO ({err}); install it with pip install "
                                      "'npumoe[intel]'.") from err
    return ov


class IntelNpuBackend(BackendBase):
    name = "intel_npu"
    caps = INTEL_NPU_CAPS

    def __init__(self, device: str | None = None, **other):
        if other:
            raise InputError(f"--{next(iter(other)).replace('_', '-')} does not apply to intel_npu; its option is "
                             "--device.")
        available = openvino().Core().available_devices
        self.device = device or ("NPU" if "NPU" in available else "CPU")
        if self.device not in DEVICES:
            raise InputError(f"--device {self.device!r} is not one of {', '.join(DEVICES)}.")
        if self.device == "NPU" and "NPU" not in available:
            raise BackendUnavailableError(f"OpenVINO lists no NPU here (devices: {', '.join(available)}); build with "
                                          "--device CPU, or on a machine with an Intel NPU and its driver.")
        self._core = None

    def lower(self, graph, weights, out_dir: Path) -> dict:
        from npumoe.backends.onnx_export import UnsupportedOp, to_onnx

        ov = openvino()
        try:
            model = to_onnx(graph, weights)
        except UnsupportedOp as err:
            raise InputError(f"graph {graph.name} has IR op {err.op.op!r}, which the ONNX export cannot lower; "
                             "place it on the CPU in the plan.") from None
        rel = Path(GRAPH_DIR) / f"{graph.name}.xml"
        (Path(out_dir) / GRAPH_DIR).mkdir(parents=True, exist_ok=True)
        # converted from memory: an ONNX file would write the fp32 weights, twice the fp16 IR's bytes, to delete them
        converted = ov.convert_model(io.BytesIO(model.SerializeToString()))
        name_nodes_by_position(converted)
        ov.save_model(converted, Path(out_dir) / rel, compress_to_fp16=True)
        names = [i.get_any_name() for i in converted.inputs]  # not "inputs": the manifest's, shapes by name
        return Lowered(FORMAT, (str(rel), str(rel.with_suffix(".bin"))),
                       {"xml": str(rel), "device": self.device, "input_names": names})

    def load(self, artifact: dict, out_dir: Path, graph, weights):
        if artifact.format != FORMAT:
            raise ArtifactError(f"{out_dir} was not built for intel_npu; "
                                "build it with npumoe build --target intel_npu.")
        if self._core is None:
            self._core = openvino().Core()
        # OpenVINO's CPU device would compute in bf16 where the CPU has it; the NPU computes in fp16, so stand-in
        # runs keep f32 and differ from the reference only by the fp16 weights
        config = {"INFERENCE_PRECISION_HINT": "f32"} if self.device == "CPU" else {}
        xml = Path(out_dir) / artifact.info["xml"]
        if self.device == "CPU" and available_memory() < HOST_SPARE + 2 * xml.with_suffix(".bin").stat().st_size:
            # the CPU device's memory is the host's, which nothing else guards: it holds each graph's fp16 weights
            # widened to f32, and a whole real-size build would fill the host until the kernel kills the process
            raise DeviceMemoryFull("the host has no room for another graph on OpenVINO's CPU device")
        compiled = self._core.compile_model(str(xml), self.device, config)
        return OpenVinoExecutor(compiled, graph, artifact.info["input_names"], self.device)

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device, "openvino": openvino().__version__,
                "weights": "fp16 (compress_to_fp16)", "mask_floor": MASK_FLOOR}


def name_nodes_by_position(model) -> None:
    """Rename the nodes OpenVINO named from its process-wide counter (``Transpose_12596``) after their position:
    otherwise a graph's IR depends on what the process converted before it, and a unit lowered by another
    worker (``--jobs``, ``--cluster``) would differ from a serial build's in every such name."""
    for position, op in enumerate(model.get_ordered_ops()):
        auto = AUTO_NAME.fullmatch(op.get_friendly_name())
        if auto:
            op.set_friendly_name(f"{auto[1]}_n{position}")


AUTO_NAME = re.compile(r"([A-Z][A-Za-z0-9]*)_\d+")  # OpenVINO's own names; ONNX's hold a '/'


class OpenVinoExecutor:
    """One compiled graph: IR tensors in, IR tensors out (masks floored at MASK_FLOOR)."""

    keeps_state = False

    def __init__(self, compiled, graph, inputs: list[str], device: str):
        self.graph, self.inputs, self.device = graph, inputs, device
        self.request = compiled.create_infer_request()
        self.outputs = [o.get_any_name() for o in compiled.outputs]

    def __call__(self, inputs):
        check_feed(self.graph, inputs, keeps_state=False, static=True)
        feed = {}
        for name in self.inputs:
            arr = inputs[name].detach().float().numpy()
            feed[name] = np.maximum(arr, MASK_FLOOR) if self.graph.inputs[name].role == Role.MASK else arr
        result = self.request.infer(feed)
        return {name: torch.from_numpy(np.asarray(result[name], dtype=np.float32)) for name in self.outputs}

    def close(self) -> None:
        """Unloaded by residency: the compiled model's memory is freed now, not when the executor is collected."""
        self.request = None


__all__ = ["IntelNpuBackend", "INTEL_NPU_CAPS"]
