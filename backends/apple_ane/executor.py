"""Executors for built ANE packages: the Core ML runtime on macOS, ``mil_exec`` everywhere else.

Both take and return the IR graph's named tensors (``h``, ``z``, ``k_new``, ``v_new`` /
``y`` / ``logits``), translating at the boundary: activations to and from [1, C, 1, S],
fp32 torch to fp16 and back. Every graph of one package shares one :class:`PackageRuntime`,
so the prefill and decode functions of an attention package read and write the same K/V
states (ANEMLL shares one ``make_state()`` across functions the same way). Such an executor
``keeps_state``: the engine passes it no ``Role.KV_CACHE`` inputs, only the position; a KV hand-off reads the
states (``read_cache``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from npumoe.backends.apple_ane.layout import from_ane, to_ane
from npumoe.backends.apple_ane.mil_exec import MilFunction
from npumoe.backends.apple_ane.mlpackage import NUMPY, Package
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.ir.backend import check_feed
from npumoe.core.ir.graph import Graph, Role


def encode_inputs(artifact: dict, inputs: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    feed = {}
    for name, spec in artifact["function_inputs"].items():
        t = inputs[name].detach()
        if spec["layout"] == "ane":
            t = to_ane(t, tuple(t.shape))
        feed[name] = t.numpy().astype(spec["dtype"])
    return feed


def decode_outputs(artifact: dict, raw: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {}
    for name, spec in artifact["function_outputs"].items():
        parts = [torch.from_numpy(np.asarray(raw[p], dtype=np.float32)) for p in output_parts(name, spec)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # channel parts of a wide output
        out[name] = from_ane(t, tuple(spec["ir_shape"])).contiguous() if spec["layout"] == "ane" else t
    return out


def output_parts(name: str, spec: dict) -> list[str]:
    """The function outputs an IR output arrives in (several for one wider than the ANE's channel axis)."""
    return spec.get("parts", [name])


class PackageRuntime:
    """One saved package on the numpy interpreter: its functions (loaded on first use) and states."""

    def __init__(self, path: Path):
        self.package = Package(path)
        self._functions: dict[str, MilFunction] = {}
        self.states: dict[str, np.ndarray] = {}

    def run(self, function: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if function not in self._functions:
            fn = MilFunction(self.package, function)
            for name, spec in fn.inputs.items():
                if spec.state:
                    self.states.setdefault(name, np.zeros(spec.shape, dtype=NUMPY[spec.dtype]))
            self._functions[function] = fn
        return self._functions[function](feed, self.states)

    def read_state(self, name: str) -> np.ndarray:
        return self.states[name]


class CoreMLRuntime:
    """One saved package on the Core ML runtime (macOS), on CPU and Neural Engine."""

    def __init__(self, path: Path):
        import coremltools as ct

        self.path, self._ct = path, ct
        self.package = Package(path)
        self._models: dict[str, object] = {}
        self.state = None

    def run(self, function: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if function not in self._models:
            self._models[function] = self._ct.models.MLModel(
                str(self.path), function_name=function, compute_units=self._ct.ComputeUnit.CPU_AND_NE)
        model = self._models[function]
        if not any(spec.state for spec in self.package.inputs(function).values()):
            return model.predict(feed)
        if self.state is None:
            self.state = model.make_state()
        return model.predict(feed, state=self.state)

    def read_state(self, name: str) -> np.ndarray:
        """State ``name`` as the functions left it (coremltools' ``MLState.read_state``, macOS)."""
        return np.asarray(self.state.read_state(name))


def runtime_for(path: Path):
    """Core ML where it runs (macOS with coremltools' runtime), the numpy interpreter elsewhere."""
    if sys.platform == "darwin":
        try:
            from coremltools import libcoremlpython  # noqa: F401
        except ImportError as err:
            raise BackendUnavailableError(
                f"coremltools' Core ML runtime is missing on this Mac ({err}); "
                "reinstall it with pip install 'npumoe[ane]'."
            ) from err
        return CoreMLRuntime(path)
    return PackageRuntime(path)


class AneExecutor:
    """One graph's function in a package: IR tensors in, IR tensors out."""

    def __init__(self, runtime, artifact: dict, graph: Graph):
        self.runtime, self.artifact, self.graph = runtime, artifact, graph
        self.function = artifact["function"]
        caches = graph.inputs_with(Role.KV_CACHE)  # a function that takes none of them holds them as states
        self.keeps_state = bool(caches) and not set(caches) & set(artifact["function_inputs"])

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feed(self.graph, inputs, keeps_state=self.keeps_state, static=True)
        raw = self.runtime.run(self.function, encode_inputs(self.artifact, inputs))
        if isinstance(raw, tuple):  # a .pte method: outputs by position
            raw = dict(zip([p for n, spec in self.artifact["function_outputs"].items()
                            for p in output_parts(n, spec)], raw))
        return decode_outputs(self.artifact, raw)

    def read_cache(self, name: str, length: int) -> torch.Tensor:
        """The first ``length`` positions of this graph's layer in the package's cache state ``name``
        (:class:`~npumoe.backends.apple_ane.kvstate.KVState`: [layers, heads, length, dim], each padded to a power
        of two), as the engine's fp32 [heads, length, dim]: what a KV hand-off reads once."""
        heads, _, dim = self.graph.inputs[name].shape
        slot = self.artifact["states"]["layers"].index(self.graph.layer)
        state = self.runtime.read_state(name)[slot, :heads, :length, :dim]
        return torch.from_numpy(np.asarray(state, dtype=np.float32))
