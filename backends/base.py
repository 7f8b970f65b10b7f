"""The backend plugin interface: what porting npumoe to a new NPU means.

A backend is one object with three members (compare ggml's backend vtable):

* ``caps``: :class:`Capabilities`, the only thing the planner knows about the device;
* ``lower(graph, weights, out_dir)``: compile one static IR graph into an artifact on disk
  (or in memory) and return a small JSON-able description of it;
* ``load(artifact, out_dir, graph, weights)``: return an executor, a callable mapping named
  input tensors to named output tensors with the graph's static shapes.

:class:`BackendBase` supplies the rest with defaults a backend may override: ``build`` (lower
every graph, with a progress bar), ``calibrate`` (a no-op; the HTP records QDQ activation
ranges there) and ``describe``.

Backends are found by name in :data:`BUILTIN` and in the ``npumoe.backends`` entry-point
group, so a third-party package can add one without touching npumoe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import torch

from npumoe.core.ir import Graph
from npumoe.errors import BackendUnavailableError, InputError

Executor = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Capabilities:
    """What the planner may assume about a device. Honest numbers, with their source."""

    name: str
    ops: frozenset[str]
    dtypes: tuple[str, ...] = ("float32",)
    static_shapes: bool = True
    alignment: int = 1  # capacities and channel counts are multiples of this
    pow2_state_dims: bool = False
    max_states: int | None = None
    max_graph_bytes: int = 1 << 62  # weights one graph may carry
    max_graphs: int | None = None  # graphs one model may load at once
    dispatch_seconds: float = 0.0  # fixed cost of one launch, host round trip included
    flops_per_second: float = 1e10  # sustained for the expert FFN shapes we emit
    notes: tuple[str, ...] = field(default_factory=tuple)

    def align(self, n: int) -> int:
        return -(-n // self.alignment) * self.alignment


class Backend(Protocol):
    name: str
    caps: Capabilities

    def lower(self, graph: Graph, weights: Mapping[str, torch.Tensor], out_dir: Path) -> dict[str, Any]: ...

    def load(self, artifact: dict[str, Any], out_dir: Path, graph: Graph, weights: Mapping[str, torch.Tensor]) -> Executor: ...

    def calibrate(self, model, plan, max_context: int, names: list[str]) -> None: ...

    def build(self, graphs: list[Graph], weights, out_dir: Path, progress: bool = True,
              jobs: int = 1) -> dict[str, dict]: ...

    def describe(self) -> dict[str, Any]: ...


class BackendBase:
    """Defaults a backend may keep: build = lower each graph in turn, with a progress bar.
    Backends that package several graphs together (Core ML multifunction) override build."""

    name = "base"

    def calibrate(self, model, plan, max_context: int, names: list[str]) -> None:
        """Before a build: record what the named NPU graphs see on the reference run. Only backends
        that quantise activations (the HTP's QDQ precisions) need it."""

    def build(self, graphs: list[Graph], weights, out_dir: Path, progress: bool = True,
              jobs: int = 1) -> dict[str, dict]:
        """Lower unit by unit (:meth:`build_units`) through the build cache: a unit lowered before (same
        IR, weights and backend) is linked from the cache, so a killed build resumes where it stopped;
        ``jobs`` > 1 lowers the missing units in that many processes."""
        from npumoe.backends.build_cache import lower_units

        units = self.build_units(graphs, weights)
        with build_progress(progress) as bar:
            task = bar.add_task(f"compiling for {self.name}", total=len(graphs))
            return lower_units(units, out_dir, bar, task, jobs)

    def build_units(self, graphs: list[Graph], weights) -> list:
        """What :meth:`build` compiles, as :class:`~npumoe.backends.build_cache.BuildUnit` s: one per graph
        here; a backend that packages several graphs together (Core ML multifunction) groups them."""
        from npumoe.backends.build_cache import BuildUnit, unit_key

        description = self.describe()
        return [BuildUnit(unit_key([g], weights, description, self.cache_salt(g)), [g],
                          lambda unit_dir, g=g: {g.name: self.lower(g, weights, unit_dir)}) for g in graphs]

    def cache_salt(self, graph: Graph):
        """What else a lowered graph depends on beyond its IR, weights and :meth:`describe` (JSON-able)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def build_progress(enabled: bool):
    """The build's progress bar: units done, elapsed, and the time left at the pace so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled, transient=True)


BUILTIN = {
    "cpu": "npumoe.backends.cpu:CpuBackend",
    "htp": "npumoe.backends.qualcomm_htp:HtpBackend",
    "ane": "npumoe.backends.apple_ane:AneBackend",
}


CAPS = {
    "cpu": "npumoe.backends.cpu:CPU_CAPS",
    "htp": "npumoe.backends.qualcomm_htp.caps:HTP_CAPS",
    "ane": "npumoe.backends.apple_ane.caps:ANE_CAPS",
}


def capabilities(target: str) -> Capabilities:
    """A target's Capabilities, without importing its toolchain."""
    if target in CAPS:
        module, attr = CAPS[target].split(":")
        return getattr(importlib.import_module(module), attr)
    return get_backend(target).caps


def available() -> dict[str, str]:
    """Backend name → "module:Class", built-ins first, then installed plugins."""
    found = dict(BUILTIN)
    for ep in entry_points(group="npumoe.backends"):
        found.setdefault(ep.name, ep.value)
    return found


def get_backend(name: str, **options) -> Backend:
    found = available()
    if name not in found:
        raise InputError(f"unknown backend {name!r}; available: {', '.join(sorted(found))}.")
    module, attr = found[name].split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise BackendUnavailableError(f"backend {name!r} could not be loaded ({err}).") from err
    return cls(**options)
