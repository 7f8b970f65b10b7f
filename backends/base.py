"""Defaults a backend may keep (see :mod:`npumoe.core.ir.backend` for the contract itself).

:class:`BackendBase` supplies ``build`` (lower every graph through the build cache, its progress on
stderr), ``calibrate`` (a no-op; the HTP records QDQ activation ranges there) and ``describe``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from npumoe.core.base.progress import task
from npumoe.core.ir.graph import Graph


class BackendBase:
    """Defaults a backend may keep: build = lower each graph in turn, its progress shown.
    Backends that package several graphs together (Core ML multifunction) override build."""

    name = "base"

    def calibrate(self, model, plan, max_context: int, names: list[str]) -> None:
        """Before a build: record what the named NPU graphs see on the reference run. Only backends
        that quantise activations (the HTP's QDQ precisions) need it."""

    def build(self, graphs: list[Graph], weights, out_dir: Path, progress: bool | None = None,
              jobs: int = 1) -> dict[str, dict]:
        """Lower unit by unit (:meth:`build_units`) through the build cache: a unit lowered before (same
        IR, weights and backend) is linked from the cache, so a killed build resumes where it stopped;
        ``jobs`` > 1 lowers the missing units in that many processes. ``progress``: see
        :mod:`npumoe.core.base.progress`."""
        from npumoe.backends.build_cache import lower_units

        units = self.build_units(graphs, weights)
        with task(f"compiling for {self.name}", len(graphs), "graphs", progress) as step:
            return lower_units(units, out_dir, step, jobs)

    def build_units(self, graphs: list[Graph], weights) -> list:
        """What :meth:`build` compiles, as :class:`~npumoe.backends.build_cache.BuildUnit` s: one per graph
        here; a backend that packages several graphs together (Core ML multifunction) groups them."""
        from npumoe.backends.build_cache import BuildUnit, unit_key

        description = self.describe()
        return [BuildUnit(unit_key([g], weights, description, self.cache_salt(g)), [g],
                          lambda unit_dir, g=g: {g.name: self.lower(g, weights, unit_dir).to_entry()})
                for g in graphs]

    def cache_salt(self, graph: Graph):
        """What else a lowered graph depends on beyond its IR, weights and :meth:`describe` (JSON-able)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

