"""The Apple Neural Engine backend: Core ML packages built the ANE way, linted, and runnable anywhere.

``build`` groups the plan's NPU graphs into packages (:mod:`.packaging`), lowers each graph
to an ANE-layout torch module (:mod:`.layout`), converts it to an fp16 ML program with our
MIL passes (:mod:`.convert`, :mod:`.passes`), compresses its weights (:mod:`.compress`),
saves each package's functions as one multifunction ``.mlpackage`` (weights stored once,
the KV cache as two states) and lints it (:mod:`.lint`). ``via="executorch"`` lowers the
same modules with ExecuTorch's Core ML partitioner to ``.pte`` instead (:mod:`.pte`).

``load`` returns executors over the saved packages: the Core ML runtime on macOS, the
numpy MIL interpreter (:mod:`.mil_exec`) elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from npumoe.backends.apple_ane.caps import ANE_CAPS
from npumoe.backends.apple_ane.compress import precision_for, scheme
from npumoe.backends.apple_ane.packaging import PackagePlan, function_name, plan_packages
from npumoe.backends.apple_ane.rules import DEFAULT_PLATFORM
from npumoe.backends.base import BackendBase
from npumoe.backends.build_cache import BuildUnit, unit_key
from npumoe.core.base.errors import ArtifactError, BackendUnavailableError, InputError
from npumoe.core.ir.backend import Lowered

VIAS = ("coreml", "executorch")
PTE_PRECISIONS = ("fp16", "int4")  # what ExecuTorch's Core ML compile specs express
PACKAGE_DIR = "packages"

def require_coremltools() -> None:
    try:
        import coremltools  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(
            f"the ANE backend needs coremltools ({err}); install it with pip install 'npumoe[ane]'."
        ) from err


class AneBackend(BackendBase):
    name = "ane"
    caps = ANE_CAPS

    def __init__(self, via: str = "coreml", precision: str = "fp16", **other):
        if other:
            raise InputError(f"--{next(iter(other))} does not apply to the ANE; its options are --via and --precision.")
        if via not in VIAS:
            raise InputError(f"--via {via!r} is not one of {', '.join(VIAS)} for the ANE.")
        scheme(precision)  # validates
        if via == "executorch" and precision not in PTE_PRECISIONS:
            raise InputError(f"--via executorch takes --precision {' or '.join(PTE_PRECISIONS)}, not {precision!r}; "
                             "use --via coreml for palettised weights.")
        self.via, self.precision = via, precision
        self.packages: dict[str, dict] = {}
        self._runtimes: dict[Path, object] = {}

    # -- build -----------------------------------------------------------------------------------
    def build(self, graphs, weights, out_dir: Path, progress: bool | None = None, jobs: int = 1) -> dict[str, dict]:
        require_coremltools()
        entries = super().build(graphs, weights, out_dir, progress, jobs)
        self.packages = {Path(e["package"]).stem: e["package_record"] for e in entries.values()}
        return entries

    def build_units(self, graphs, weights) -> list[BuildUnit]:
        """One unit per package: its graphs share weights, so they are lowered together."""
        description = {k: v for k, v in self.describe().items() if k != "packages"}  # packages: what is built
        return [BuildUnit(unit_key(pkg.graphs, weights, description), pkg.graphs,
                          lambda unit_dir, pkg=pkg: self._build_package(pkg, weights, unit_dir))
                for pkg in plan_packages(graphs, weights, self.precision, DEFAULT_PLATFORM)]

    def _build_package(self, pkg: PackagePlan, weights, out_dir: Path) -> dict[str, dict]:
        precision = precision_for(pkg.kind, self.precision)
        if self.via == "executorch":
            rel, fmt = Path(PACKAGE_DIR) / f"{pkg.name}.pte", "pte"
            entries = self._save_pte(pkg, weights, out_dir / rel, precision)
        else:
            rel, fmt = Path(PACKAGE_DIR) / f"{pkg.name}.mlpackage", "mlprogram"
            entries = self._save_mlpackage(pkg, weights, out_dir / rel, precision)
        record = {
            "path": str(rel),
            "functions": [function_name(g) for g in pkg.graphs],
            "states": pkg.kv.to_json() if pkg.kv else None,
            "precision": precision,
            "bytes": sum(p.stat().st_size for p in [out_dir / rel, *(out_dir / rel).rglob("*")] if p.is_file()),
        }
        return {g.name: {**entries[g.name], "format": fmt, "package": str(rel), "files": [str(rel)],
                         "package_record": record} for g in pkg.graphs}

    def _save_mlpackage(self, pkg: PackagePlan, weights, path: Path, precision: str) -> dict[str, dict]:
        """Each graph is traced, converted and saved on its own, then the functions are merged:
        one graph's weights in memory at a time, however many share the package."""
        from npumoe.backends.apple_ane import lint
        from npumoe.backends.apple_ane.compress import luts_arrays
        from npumoe.backends.apple_ane.convert import PackageWriter, convert_graph, converter_scratch
        from npumoe.backends.apple_ane.layout import AneGraphModule

        entries = {}
        with PackageWriter(path) as writer:
            for g in pkg.graphs:
                module = AneGraphModule(g, weights, pkg.kv)
                entries[g.name] = self._entry(g, module, pkg, precision)
                arrays = luts_arrays(module, weights, precision) if precision != "fp16" else None
                with converter_scratch(sum(b.nbytes for b in module.buffers())):
                    writer.add(function_name(g), convert_graph(module, precision, arrays))
                del module
        lint.check(path)
        return entries

    def _save_pte(self, pkg: PackagePlan, weights, path: Path, precision: str) -> dict[str, dict]:
        """ExecuTorch lowers a package's methods together, so its modules are all held at once."""
        import torch

        from npumoe.backends.apple_ane.layout import AneGraphModule
        from npumoe.backends.apple_ane.pte import save_pte

        modules = {function_name(g): AneGraphModule(g, weights, pkg.kv, dtype=torch.float32) for g in pkg.graphs}
        save_pte(modules, path, precision)
        return {g.name: self._entry(g, modules[function_name(g)], pkg, precision) for g in pkg.graphs}

    def _entry(self, graph, module, pkg: PackagePlan, precision: str) -> dict:
        shapes = module.input_shapes()
        return {
            "function": function_name(graph),
            "function_inputs": {n: {"shape": list(shapes[n]), "layout": layout,
                                    "dtype": "int32" if module.input_is_int(n) else "float16"}
                                for n, layout in module.input_layouts().items()},
            "function_outputs": {n: {"ir_shape": list(graph.outputs[n].shape), "layout": layout,
                                     "parts": module.output_parts()[n]}
                                 for n, layout in module.output_layouts().items()},
            "states": pkg.kv.to_json() if pkg.kv else None,
            "compression": {"precision": precision, "op": scheme(precision).op,
                            "scheme": scheme(precision).description},
        }

    def lower(self, graph, weights, out_dir: Path) -> Lowered:
        """One graph as its own package (``build`` is the normal path: it shares packages)."""
        return Lowered.from_entry(self.build([graph], weights, out_dir, progress=False)[graph.name])

    # -- run -------------------------------------------------------------------------------------
    def load(self, artifact: dict, out_dir: Path, graph, weights):
        from npumoe.backends.apple_ane.executor import AneExecutor, runtime_for

        if artifact.format not in ("mlprogram", "pte"):
            raise ArtifactError(f"{out_dir} was not built for the ANE; build it with npumoe build --target ane.")
        path = Path(out_dir) / artifact.info["package"]
        if path not in self._runtimes:
            if artifact.format == "pte":
                from npumoe.backends.apple_ane.pte import PteRuntime

                self._runtimes[path] = PteRuntime(path)
            else:
                self._runtimes[path] = runtime_for(path)
        runtime = self._runtimes[path]
        if artifact.format == "mlprogram":
            runtime.package.function(artifact.info["function"])  # a manifest naming a missing function fails here
        return AneExecutor(runtime, artifact.info, graph)

    def describe(self) -> dict:
        return {"name": self.name, "via": self.via, "precision": self.precision,
                "deployment_target": "iOS18 / macOS15", "compute_precision": "float16",
                "platform": DEFAULT_PLATFORM, "packages": self.packages}


__all__ = ["AneBackend", "ANE_CAPS"]
