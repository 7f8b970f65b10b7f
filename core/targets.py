"""One model, every target: calibrate once, plan each target from its own Capabilities, build each, and
validate each against the fp32 reference on held-out text, into one directory.

Layout (the top-level ``manifest.json`` says which model and lists the targets; each target's directory
is an ordinary artifact directory, so the per-target tools read it unchanged)::

    OUT/manifest.json      kind npumoe.Targets: model and weights fingerprints, chunk, context,
                           held-out text, and per target its directory, options, plan summary, validation
    OUT/profile.json       the one routing profile every plan came from
    OUT/<target>/          npumoe build's artifact directory for that target (its own manifest.json)
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from npumoe.core.artifacts import MANIFEST, build
from npumoe.core.backend import get_backend, plugin, plugins
from npumoe.core.calibrate import calibrate
from npumoe.core.costmodel import workload
from npumoe.core.io import atomic_write_text, read_json_artifact
from npumoe.core.outputs import OutputKind, claim, json_kind, staged_directory
from npumoe.core.plan import GRAPHS_PER_LAYER, plan
from npumoe.core.validate import validate
from npumoe.errors import ArtifactError, InputError, NpumoeError

KIND = "npumoe.Targets"
TARGETS = OutputKind("an npumoe multi-target build (npumoe build --targets)", directory=True,
                     recognise=lambda path: json_kind(KIND)(path / MANIFEST))
PROFILE_FILE = "profile.json"


def check_targets(targets: list[str], options: dict[str, dict]) -> None:
    """Every target installed, an NPU (the CPU runs unplanned graphs and builds nothing), and constructible
    with its options — checked before the minutes of calibration, so a missing toolchain fails first."""
    if not targets:
        raise InputError("--targets is empty; name one or more NPU targets, e.g. --targets htp,ane.")
    for target in targets:
        if target == "cpu":
            raise InputError("--targets names cpu, which runs graphs as they are and builds nothing; name NPU "
                             "targets (the CPU reference is what every target is validated against).")
        plugin(target)
        get_backend(target, **options.get(target, {}))


def build_targets(model, targets: list[str], texts: dict[str, str], heldout_ids, out_dir, *, chunk: int,
                  max_context: int = 512, residency: str = "auto", options: dict[str, dict] | None = None,
                  progress: bool = True, report=lambda message: None, profile=None,
                  graphs_per_layer: int = GRAPHS_PER_LAYER) -> dict:
    """Build ``targets`` from one calibration of ``texts`` (or the given ``profile``); validate each on
    ``heldout_ids``; return the top-level manifest. ``report`` hears one line per step (the CLI prints them)."""
    options = options or {}
    out_dir = claim(out_dir, TARGETS)
    check_targets(targets, options)
    if profile is None:
        report(f"calibrating on {len(texts)} text(s), chunk {chunk}")
        profile = calibrate(model, list(texts.values()), chunk=chunk, progress=progress, sources=list(texts)[:50])
    entries = {}
    with staged_directory(out_dir) as staging:
        profile.save(staging / PROFILE_FILE)
        for target in targets:
            report(f"{target}: planning, building")
            target_plan = plan(model, profile, target=target, residency=residency, graphs_per_layer=graphs_per_layer)
            build(model, target_plan, target, staging / target, max_context=max_context, progress=progress,
                  **options.get(target, {}))
            report(f"{target}: validating on {len(heldout_ids)} held-out tokens")
            checked = validate(model, target, staging / target, heldout_ids)
            work = workload(model.spec, target_plan, checked.npu_launches_per_chunk)
            entries[target] = {"dir": target, "options": options.get(target, {}), "predicted": target_plan.predicted,
                               "cpu_graphs": target_plan.cpu_graphs, "validation": checked.to_json(),
                               "workload": asdict(work)}
        manifest = {"kind": KIND, "model": model.spec.fingerprint(), "model_name": model.name,
                    "weights": model.weights_fingerprint(), "chunk": chunk, "max_context": max_context,
                    "profile": PROFILE_FILE, "heldout_tokens": int(len(heldout_ids)), "targets": entries}
        atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1))  # targets in the order given
    return manifest


def installed_npu_targets() -> tuple[list[str], dict[str, str]]:
    """The NPU targets whose toolchains load here, and why each other one does not."""
    usable, missing = [], {}
    for name in plugins():
        if name == "cpu":
            continue
        try:
            get_backend(name)
            usable.append(name)
        except NpumoeError as err:
            missing[name] = str(err)
    return usable, missing


def read_targets(out_dir) -> dict | None:
    """The top-level manifest of a multi-target build, or None when ``out_dir`` is a single target's."""
    path = Path(out_dir) / MANIFEST
    if not json_kind(KIND)(path):
        return None
    manifest = read_json_artifact(path, KIND, "a multi-target build (npumoe build --targets)")
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
