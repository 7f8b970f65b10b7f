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

from npumoe.core.base.errors import InputError, NpumoeError
from npumoe.core.base.io import atomic_write_text
from npumoe.core.base.outputs import OutputKind, check_free_space, claimed, json_kind, staged_directory
from npumoe.core.compiler.artifacts import MANIFEST, TARGETS_KIND, build
from npumoe.core.ir.backend import get_backend, plugin, plugins
from npumoe.core.planning.costmodel import footprint, workload
from npumoe.core.planning.plan import GRAPHS_PER_LAYER, plan
from npumoe.core.runtime.calibrate import calibrate
from npumoe.core.tools.validate import validate

TARGETS = OutputKind("an npumoe multi-target build (npumoe build --targets)", directory=True,
                     recognise=lambda path: json_kind(TARGETS_KIND)(path / MANIFEST))
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
                  progress: bool | None = None, report=lambda message: None, profile=None,
                  graphs_per_layer: int = GRAPHS_PER_LAYER, jobs=1) -> dict:
    """Build ``targets`` from one calibration of ``texts`` (or the given ``profile``); validate each on
    ``heldout_ids``; return the top-level manifest. ``report`` hears one line per step (the CLI prints them);
    ``progress`` shows each step's own (see :mod:`npumoe.core.base.progress`); ``jobs`` is
    :func:`~npumoe.core.compiler.artifacts.build`'s."""
    options = options or {}
    with claimed(out_dir, TARGETS) as out_dir:
        check_targets(targets, options)
        if profile is None:
            report(f"calibrating on {len(texts)} text(s), chunk {chunk}")
            profile = calibrate(model, list(texts.values()), chunk=chunk, progress=progress, sources=list(texts)[:50])
        entries = {}
        plans = {target: plan(model, profile, target=target, residency=residency, graphs_per_layer=graphs_per_layer)
                 for target in targets}
        needs = {target: footprint(model.spec, plans[target], max_context,
                                   options.get(target, {}).get("precision", "fp16")) for target in targets}
        check_free_space(out_dir, sum(need.package_weight_bytes for need in needs.values()))
        with staged_directory(out_dir) as staging:
            profile.save(staging / PROFILE_FILE)
            for target in targets:
                report(f"{target}: building")
                target_plan, need = plans[target], needs[target]
                build(model, target_plan, target, staging / target, max_context=max_context, progress=progress,
                      jobs=jobs, **options.get(target, {}))
                report(f"{target}: validating on {len(heldout_ids)} held-out tokens")
                checked = validate(model, target, staging / target, heldout_ids, progress=progress)
                work = workload(model.spec, target_plan, checked.npu_launches_per_chunk)
                entries[target] = {"dir": target, "options": options.get(target, {}), "predicted": target_plan.predicted,
                                   "cpu_graphs": target_plan.cpu_graphs, "validation": checked.to_json(),
                                   "workload": asdict(work), "footprint": asdict(need)}
            manifest = {"kind": TARGETS_KIND, "model": model.spec.fingerprint(), "model_name": model.name,
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


