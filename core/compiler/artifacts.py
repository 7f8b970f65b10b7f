"""Built artifacts on disk: ``npumoe build`` writes them, ``Engine(backend=..., artifacts=...)`` runs them.

An artifact directory holds whatever the backend wrote for each NPU-placed graph plus
``manifest.json``: target, backend details, the model and weights fingerprints, the plan, every graph's
inputs and outputs, and the sha256 of every file and of what the graphs were compiled from (the plan and
the context length): the graphs hold the plan's experts in its order and caches of that length, so a plan
or context edited in the manifest would run them as other experts or feed them other shapes. The rest
a run reads (chunk, target, each graph's size and files) is checked against them before use. Building
happens in a temporary
sibling directory that replaces the destination only when complete, so a failed or
interrupted build never leaves a half-written artifact behind; the destination must be new or
an earlier artifact directory (:mod:`npumoe.core.base.outputs`). Every path a manifest names must lie
inside its directory: a manifest is input, and one edited to say ``../../etc/passwd`` is refused.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.io import atomic_write_text, read_json_artifact, sha256_file, sha256_json
from npumoe.core.base.outputs import OutputKind, claimed, json_kind, staged_directory
from npumoe.core.base.progress import task, track
from npumoe.core.compiler.program import build_program
from npumoe.core.ir.backend import Executor, Lowered
from npumoe.core.ir.graph import Graph
from npumoe.core.ir.identity import check_weights

MANIFEST = "manifest.json"
KIND = "npumoe.Artifacts"
ARTIFACTS = OutputKind("an npumoe artifact directory", directory=True,
                       recognise=lambda path: json_kind(KIND)(path / MANIFEST))


def io_description(graph: Graph) -> dict:
    return {
        "kind": graph.kind,
        "layer": graph.layer,
        "inputs": {n: list(t.shape) for n, t in graph.inputs.items()},
        "outputs": {n: list(t.shape) for n, t in graph.outputs.items()},
    }


def build(model, plan, target: str, out_dir: str | Path, max_context: int = 512, progress: bool | None = None,
          layers: set[int] | None = None, jobs: int = 1, **backend_options) -> dict:
    """Lower every NPU-placed graph of the planned program for ``target``; return the manifest.

    ``layers`` builds only those layers' graphs, for a quick look at a large model (the result
    records it and does not run); ``jobs`` lowers that many units at once, in processes; ``progress`` (see
    :mod:`npumoe.core.base.progress`) shows the backend's calibration and the compiles."""
    from npumoe.core.ir.backend import get_backend

    with claimed(out_dir, ARTIFACTS) as out_dir:
        if plan.target != target:
            raise InputError(f"the plan was made for target {plan.target!r}, not {target!r}; "
                             f"re-plan with --target {target}.")
        plan.check_model(model)
        program = build_program(model.spec, chunk=plan.chunk, max_context=max_context, plan=plan)
        npu_graphs = [g for g in program.graphs.values() if g.placement == "npu"]
        if not npu_graphs:
            raise InputError("the plan places no graph on the NPU (residency cpu?); there is nothing to build.")
        if layers is not None:
            outside = sorted(set(layers) - set(range(model.spec.num_layers)))
            if outside:
                raise InputError(f"--layers names layer {outside[0]}, but {model.name} has layers 0-"
                                 f"{model.spec.num_layers - 1}.")
            npu_graphs = [g for g in npu_graphs if g.layer in layers]
            if not npu_graphs:
                raise InputError(f"the plan places no graph of layers {sorted(layers)} on the NPU; nothing to build.")
        backend = get_backend(target, **backend_options)
        with task(f"calibrating {target}'s graphs", progress=progress):
            backend.calibrate(model, plan, max_context, [g.name for g in npu_graphs])
        with staged_directory(out_dir) as staging:
            entries = backend.build(npu_graphs, model.weights, staging, progress=progress, jobs=jobs)
            manifest = {
                "kind": KIND,
                "target": target,
                "backend": backend.describe(),
                "model": model.spec.fingerprint(),
                "weights": model.weights_fingerprint(),
                "model_name": model.name,
                "chunk": plan.chunk,
                "max_context": max_context,
                "plan": plan.to_json(),
                "layers": sorted(layers) if layers is not None else None,  # a partial build when set
                "graphs": {g.name: {**io_description(g), **entries[g.name], "bytes": _bytes(staging, entries[g.name])}
                           for g in npu_graphs},
                "files": {
                    str(p.relative_to(staging)): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()
                },
            }
            manifest["build_sha256"] = build_digest(manifest)
            atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        return manifest


def _bytes(root: Path, entry: dict) -> int:
    """Bytes on disk of the files an entry names (a directory counts with everything in it)."""
    paths = [root / rel for rel in entry.get("files", [])]
    return sum(p.stat().st_size for top in paths for p in [top, *top.rglob("*")] if p.is_file())


def read_manifest(out_dir: str | Path, verify: bool = True) -> dict:
    """The manifest, after checking every file against its recorded sha256."""
    out_dir = Path(out_dir)
    manifest = read_json_artifact(out_dir / MANIFEST, KIND, "an artifact directory (npumoe build --out)")
    files, graphs = manifest.get("files"), manifest.get("graphs")  # paths first: nothing outside is ever opened
    _check_paths_inside(out_dir, [*(files if isinstance(files, dict) else {}),
                                  *_strings(graphs if isinstance(graphs, dict) else {})])
    _check_fields(out_dir, manifest)
    _check_bound(out_dir, manifest)
    if verify:
        for rel, digest in track(manifest["files"].items(), f"verifying {out_dir}", "files"):
            path = out_dir / rel
            if not path.is_file():
                raise ArtifactError(f"{path} is listed in the manifest but missing; rebuild with npumoe build.")
            if sha256_file(path) != digest:
                raise ArtifactError(
                    f"{path} no longer matches the sha256 in its manifest; it was altered after the build. "
                    "Rebuild with npumoe build (or restore the file)."
                )
    return manifest


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# what the engine and loaders read from a manifest, and the test each value must pass
_FIELDS = {
    "target": lambda v: isinstance(v, str),
    "backend": lambda v: isinstance(v, dict),
    "model": lambda v: isinstance(v, str),
    "weights": lambda v: v is None or isinstance(v, str),
    "chunk": lambda v: _whole(v, 1),
    "max_context": lambda v: _whole(v, 1),
    "plan": lambda v: isinstance(v, dict),
    "layers": lambda v: v is None or (isinstance(v, list) and all(_whole(x, 0) for x in v)),
    "graphs": lambda v: isinstance(v, dict) and all(isinstance(g, dict) for g in v.values()),
    "files": lambda v: isinstance(v, dict) and all(isinstance(d, str) for d in v.values()),
}


def _check_fields(out_dir: Path, manifest: dict) -> None:
    """Refuse a manifest missing a field the run reads, or holding one of the wrong type, before it is used:
    a manifest is input, and an edited one must be named, not fail as a KeyError deep in the engine."""
    for name, valid in _FIELDS.items():
        if name not in manifest and name in ("weights", "layers"):
            continue  # manifests from before these fields: refused (weights) or whole (layers) elsewhere
        if name not in manifest or not valid(manifest[name]):
            got = f"holds {name!r} = {manifest[name]!r:.60}" if name in manifest else f"has no {name!r}"
            raise ArtifactError(f"{out_dir / MANIFEST} {got}; the manifest was altered, rebuild with npumoe build.")


def build_digest(manifest: dict) -> str:
    """The sha256 of what a build's graphs were compiled from: its plan and context length."""
    return sha256_json({"plan": manifest["plan"], "max_context": manifest["max_context"]})


def _check_bound(out_dir: Path, manifest: dict) -> None:
    """Refuse a manifest whose plan or context length is not what its graphs were compiled from (its
    build_sha256), or whose chunk or target disagrees with that plan."""
    where = out_dir / MANIFEST
    if "build_sha256" not in manifest:
        raise ArtifactError(f"{where} records no build_sha256 (built before plans were bound to their artifacts); "
                            "rebuild with npumoe build.")
    if manifest["build_sha256"] != build_digest(manifest):
        raise ArtifactError(f"{where}'s plan or max_context no longer matches its build_sha256; it was altered after "
                            "the build. Rebuild with npumoe build.")
    for name in ("chunk", "target"):
        if manifest[name] != manifest["plan"].get(name):
            raise ArtifactError(f"{where} holds {name} {manifest[name]!r:.30} but its plan's is "
                                f"{manifest['plan'].get(name)!r:.30}; the manifest was altered, rebuild with npumoe "
                                "build.")


def _strings(value) -> list[str]:
    """Every string inside a graph entry: backends name their files in fields of their own choosing, so
    all of them are checked as paths (a function or precision name always resolves inside)."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in _strings(item)]


def _check_paths_inside(out_dir: Path, names: list[str]) -> None:
    """Refuse a manifest that names a path outside its directory (``..``, absolute, or through a symlink)
    before anything is opened."""
    root = out_dir.resolve()
    for name in names:
        if "\x00" in name:  # no file system path holds one (and resolve() raises ValueError on it)
            raise ArtifactError(f"{out_dir / MANIFEST} names {name!r}, which no path can hold; the manifest was "
                                "altered, rebuild with npumoe build.")
        if not (root / name).resolve().is_relative_to(root):
            raise ArtifactError(f"{out_dir / MANIFEST} names {name!r}, which lies outside {out_dir}; the manifest "
                                "was altered, rebuild with npumoe build.")


def check_built_for(manifest: dict, out_dir: str | Path, model) -> None:
    """Refuse artifacts built for another architecture or from other weights: they hold the weights compiled
    in, so a fine-tune run on its base model's artifacts would print the base model's text. A manifest from
    before weights were recorded is refused too, since nothing says which weights it holds."""
    if manifest["model"] != model.spec.fingerprint():
        raise ArtifactError(
            f"{out_dir} was built for {manifest.get('model_name')} (fingerprint {manifest['model']}), "
            f"not {model.name}; rebuild for this model."
        )
    check_weights(manifest.get("weights"), model, f"the artifact directory {out_dir}", manifest.get("model_name"),
                  f"rebuild it for {model.name} with npumoe build", required=True)


def executor_loaders(backend, out_dir: str | Path, graphs: list[Graph], weights,
                     model) -> tuple[dict[str, Callable[[], Executor]], dict[str, int]]:
    """For the given NPU graphs of a verified artifact directory: a loader of each one's executor, and the
    bytes each occupies once loaded (its artifact's size). Verified once here; each load reads one graph."""
    manifest = read_manifest(out_dir)
    check_built_for(manifest, out_dir, model)
    built_by, loading_by = manifest["backend"].get("name"), backend.describe().get("name")
    if built_by != loading_by:
        raise ArtifactError(f"{out_dir} holds a build for {manifest['target']}, which {loading_by} cannot load; pass "
                            f"--target {manifest['target']}, or build for {loading_by}.")
    missing = [g.name for g in graphs if g.name not in manifest["graphs"]]
    if missing and manifest.get("layers") is not None:
        raise ArtifactError(f"{out_dir} holds only layers {manifest['layers']} (built with --layers), not "
                            f"{missing[0]!r}; build every layer to run the model.")
    if missing:
        raise ArtifactError(f"{out_dir} has no compiled graph {missing[0]!r}; it was built from another plan.")
    entries = {g.name: manifest["graphs"][g.name] for g in graphs}
    for name, entry in entries.items():
        _check_entry(out_dir, name, entry)
    loaders = {g.name: functools.partial(backend.load, Lowered.from_entry(entries[g.name]), Path(out_dir), g, weights)
               for g in graphs}
    return loaders, {name: entry.get("bytes", 0) for name, entry in entries.items()}


def _check_entry(out_dir, name: str, entry: dict) -> None:
    """Refuse a graph entry whose size or file list is not one: the residency budget adds up the one, and the
    backend's loader opens the other."""
    def altered(what: str) -> ArtifactError:
        return ArtifactError(f"{Path(out_dir) / MANIFEST} records graph {name}'s {what}; the manifest was altered, "
                             "rebuild with npumoe build.")

    if not _whole(entry.get("bytes", 0), 0):
        raise altered(f"size as {entry['bytes']!r:.30} bytes")
    files = entry.get("files", [])
    if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
        raise altered(f"files as {files!r:.60}, not a list of paths")


def load_executors(backend, out_dir: str | Path, graphs: list[Graph], weights, model) -> dict:
    """Executors for the given NPU graphs from a verified artifact directory."""
    return {name: load() for name, load in executor_loaders(backend, out_dir, graphs, weights, model)[0].items()}


TARGETS_KIND = "npumoe.Targets"  # the top-level manifest of a multi-target build


def read_targets(out_dir) -> dict | None:
    """The top-level manifest of a multi-target build, or None when ``out_dir`` is a single target's."""
    path = Path(out_dir) / MANIFEST
    if not json_kind(TARGETS_KIND)(path):
        return None
    manifest = read_json_artifact(path, TARGETS_KIND, "a multi-target build (npumoe build --targets)")
    if not isinstance(manifest.get("targets"), dict):
        raise ArtifactError(f"{path} has no 'targets'; the manifest was altered, rebuild with npumoe build.")
    return manifest


def target_directory(out_dir, target: str) -> Path:
    """Where ``target``'s artifacts are: ``out_dir`` itself, or its subdirectory in a multi-target build."""
    manifest = read_targets(out_dir)
    if manifest is None:
        return Path(out_dir)
    if target not in manifest["targets"]:
        raise InputError(f"{out_dir} holds builds for {', '.join(manifest['targets'])}, not {target!r}; pass "
                         f"--target {' or '.join(manifest['targets'])}.")
    entry = manifest["targets"][target]
    directory = (Path(out_dir) / str(entry.get("dir", ""))).resolve()
    if not directory.is_relative_to(Path(out_dir).resolve()) or directory == Path(out_dir).resolve():
        raise ArtifactError(f"{Path(out_dir) / MANIFEST} names {entry.get('dir')!r} for {target}, which is not a "
                            "directory inside it; the manifest was altered, rebuild with npumoe build.")
    return directory
