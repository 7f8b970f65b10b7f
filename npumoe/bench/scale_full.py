"""``npumoe bench scale --full``: the whole checkpoint calibrated once, then planned, built for each target and run
end to end through the built artifacts, each command in its own measured process.

The end-to-end check is top-1 agreement on the same tokens: the CPU reference (the checkpoint's bf16 through
npumoe's own engine, no plan) reads the prompt plus the target's new tokens, and each of its next-token argmaxes
is compared with the token the target picked there. Comparing two free-running generations would count every token
after a first difference as a disagreement.

Real-size runs take hours, so a run survives being killed: its work directory keeps the profile, the plans, the
build cache and ``steps.jsonl``, where each step is appended once it and its figures are complete; a run started
again on the same directory skips the steps recorded there, and an interrupted build resumes from its cache.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from npumoe.core.base.errors import InputError

PROMPT_TOKENS, NEW_TOKENS = 64, 8
TARGETS = ("htp", "ane", "intel_npu")
UNITS = {"htp": "QNN contexts", "ane": "Core ML packages", "intel_npu": "compiled models"}  # what one file set is
WORK_KIND = "npumoe-bench-scale-full"
MARKER, RECORD = "bench-full.json", "steps.jsonl"
MAX_CONTEXT = 512  # plan's and build's default: the context the device verdicts are for


def prompt_ids(text: Path) -> list[int]:
    """The first ``PROMPT_TOKENS`` bytes of the calibration text (the bench checkpoints have a byte tokenizer)."""
    return list(text.read_bytes()[:PROMPT_TOKENS])


def parse_targets(value: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(t.strip() for t in value.split(",") if t.strip()))
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown or not chosen:
        raise InputError(f"--targets {value!r}: {'unknown target ' + repr(unknown[0]) if unknown else 'none named'}; "
                         f"choose from {','.join(TARGETS)}.")
    return chosen


def check_work(work: Path) -> dict:
    """What ``work`` records of an earlier run ({} when it is new or empty); anything else is refused, untouched."""
    if work.exists() and not work.is_dir():
        raise InputError(f"--work {work} is a file; give a directory (new, or an earlier --full run's).")
    if not work.is_dir() or not any(work.iterdir()):
        return {}
    try:
        found = json.loads((work / MARKER).read_text())
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or found.get("kind") != WORK_KIND:
        raise InputError(f"--work {work} exists and is not a bench scale --full work directory (no {MARKER}); "
                         "give a new path or an earlier run's.")
    return found


def open_work(work: Path, ckpt: Path) -> dict[str, dict]:
    """Claim ``work`` for a run on ``ckpt`` (new, empty, or an earlier run's on the same checkpoint); the steps it
    recorded, by key."""
    marker = {"kind": WORK_KIND, "checkpoint": str(ckpt.resolve())}
    found = check_work(work)
    if found and found.get("checkpoint") != marker["checkpoint"]:
        raise InputError(f"--work {work} holds a run on {found.get('checkpoint')}, not {marker['checkpoint']}; "
                         "give a new --work for this checkpoint.")
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text(json.dumps(marker))
    done = {}
    if (work / RECORD).is_file():
        for line in (work / RECORD).read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            done[entry["key"]] = entry
    return done


def run_full(ckpt: Path, work: Path, targets: tuple[str, ...], console: Console, measure, calibration_text,
             keep_builds: bool = False) -> dict:
    """Each command as a user runs it on the whole ``ckpt``, measured by ``measure``, for each target; the built
    artifacts' figures, the device verdicts and the end-to-end agreement. Steps already in ``work``'s record are not
    run; ``calibration_text(work)`` writes the text calibrate reads where it is missing."""
    done = open_work(work, ckpt)
    text = work / "calibration.txt"
    if not text.exists():
        calibration_text(work)
    model, profile, ids = ["--model", str(ckpt)], work / "profile.json", prompt_ids(text)

    def step(key: str, argv: list[str], output: Path | None, env: dict | None = None, figures=None) -> dict:
        """The recorded step ``key`` if its output is still there, else ``argv`` measured, with ``figures(result)``
        added, appended to the record."""
        if key in done and (output is None or output.exists()):
            console.print(f"[dim]{key}: done in an earlier run[/dim]")
            return done[key]
        console.print(f"[dim]npumoe {' '.join(argv)[:160]}[/dim]")
        result = {"key": key, **measure(argv, env)}
        result |= figures(result) if figures else {}
        del result["stdout"]
        with open(work / RECORD, "a") as f:
            f.write(json.dumps(result) + "\n")
        done[key] = result
        return result

    steps = [step("calibrate", ["calibrate", *model, "--dtype", "bfloat16", "--text", str(text), "--chunk", "256",
                                "--out", str(profile)], profile)]
    per_target = {}
    for target in targets:
        plan, build = work / f"plan-{target}.json", work / f"build-{target}"
        cache = work / "build-cache" / target  # compiled here, never found in the user's cache
        generated = f"generate {target}" in done
        resumed = cache.is_dir() and any(cache.iterdir())  # a killed build's units: its wall time is the rest's
        runs = [
            step(f"plan {target}", ["plan", *model, "--profile", str(profile), "--target", target, "--residency", "npu",
                                    "--out", str(plan)], plan,
                 figures=lambda _, t=target, p=plan: device_fit(ckpt, t, p)),
            step(f"build {target}", ["build", *model, "--plan", str(plan), "--target", target, "--out", str(build)],
                 None if generated else build / "manifest.json", {**os.environ, "NPUMOE_BUILD_CACHE": str(cache)},
                 figures=lambda _, t=target, b=build, r=resumed: {"resumed": r,
                                                                 "artifacts": artifact_figures(ckpt, b, t)}),
            step(f"generate {target}", ["generate", *model, "--plan", str(plan), "--target", target, "--artifacts",
                                        str(build), "--ids", ",".join(map(str, ids)), "-n", str(NEW_TOKENS)], None,
                 figures=lambda r: end_to_end(ckpt, ids, r)),
        ]
        if not keep_builds:  # ~ the checkpoint's size each; the output hard-links the cache's files: both go
            shutil.rmtree(build, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
        plan_r, build_r, gen_r = runs
        per_target[target] = {"fits": plan_r["fits"], "artifacts": build_r["artifacts"],
                              "agreement": gen_r["agreement"], "decode_s_per_token": gen_r["decode_s_per_token"],
                              "build_resumed": build_r["resumed"]}
        steps += runs
    return {"steps": [{k: v for k, v in s.items() if k not in ("fits", "artifacts", "agreement")} for s in steps],
            "targets": per_target, "builds_kept": keep_builds}


def device_fit(ckpt: Path, target: str, plan_path: Path) -> dict:
    """The verdicts ``npumoe plan`` printed for each of ``target``'s devices, as JSON."""
    from npumoe.core.planning.costmodel import footprint, verdicts
    from npumoe.core.planning.plan import Plan
    from npumoe.models.loader import config_spec, read_config

    spec = config_spec(read_config(ckpt))[1]
    return {"fits": [v.to_json() for v in verdicts(target, footprint(spec, Plan.load(plan_path), MAX_CONTEXT))]}


def artifact_figures(ckpt: Path, build: Path, target: str) -> dict:
    """Graphs, the file sets they are stored in (QNN contexts, Core ML packages, compiled models), bytes on disk,
    and each weight those graphs read counted once at the precision the backend stores it."""
    from npumoe.core.compiler.artifacts import target_directory
    from npumoe.core.compiler.program import build_program
    from npumoe.core.ir.weights import expected_shapes
    from npumoe.core.planning.costmodel import weight_bits
    from npumoe.core.planning.plan import Plan
    from npumoe.models.loader import config_spec, read_config

    out = target_directory(build, target)
    manifest = json.loads((out / "manifest.json").read_text())
    spec = config_spec(read_config(ckpt))[1]
    shapes = expected_shapes(spec) | {"lm_head.weight": (spec.vocab_size, spec.hidden_size)}
    plan = Plan.from_json(manifest["plan"])
    program = build_program(spec, chunk=plan.chunk, max_context=manifest["max_context"], plan=plan)
    precision = manifest["backend"].get("precision", "fp16")
    bits = weight_bits(target, precision)
    held = {}  # weight → the kind of the first graph reading it
    for name in manifest["graphs"]:
        graph = program.graphs[name]
        held |= {n: graph.kind for n in graph.weight_names() if n not in held}
    weights = sum(bits(kind) / 8 * math.prod(shapes[n]) for n, kind in held.items())
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    units = {tuple(sorted(e["files"])) for e in manifest["graphs"].values()}
    return {"graphs": len(manifest["graphs"]), "units": len(units), "unit_name": UNITS[target],
            "precision": precision, "bytes_on_disk": on_disk, "weights_held_bytes": weights,
            "of_weights": on_disk / weights}


def end_to_end(ckpt: Path, prompt: list[int], generated: dict) -> dict:
    new = [int(t) for t in generated["stdout"].split()]
    return {"agreement": agreement(ckpt, prompt, new), "decode_s_per_token": seconds_per_token(generated["summary"])}


def agreement(ckpt: Path, prompt: list[int], new: list[int]) -> dict:
    """How many of the target's new tokens are the CPU reference's top-1 on the same preceding tokens."""
    import numpy as np

    import npumoe

    reference = npumoe.Engine(npumoe.load(ckpt, dtype="bfloat16"))
    logits = reference.forward(np.asarray(prompt + new[:-1]))
    picked = logits[len(prompt) - 1:].argmax(axis=-1).tolist()
    return {"tokens": new, "reference_top1": picked, "agree": sum(a == b for a, b in zip(new, picked)),
            "of": len(new)}


def seconds_per_token(summary: str) -> float | None:
    found = re.search(r"decode ([0-9.e+-]+) s/token", summary)
    return float(found.group(1)) if found else None


def fit_cell(verdicts: list[dict]) -> str:
    """e.g. "fits M4 Max; not M2/M4/A17 Pro/A18" (a first word all the devices share is left out)."""
    if not verdicts:
        return "no device records"
    names = [v["device"] for v in verdicts]
    first = {n.split(" ", 1)[0] for n in names}
    if len(first) == 1 and all(" " in n for n in names):
        names = [n.split(" ", 1)[1] for n in names]
    fits = [n for n, v in zip(names, verdicts) if v["fits"]]
    nots = [n for n, v in zip(names, verdicts) if not v["fits"]]
    return "; ".join([*(["fits " + "/".join(fits)] if fits else []), *(["not " + "/".join(nots)] if nots else [])])


def print_full(result: dict, console: Console) -> None:
    full, name = result["full"], Path(result["checkpoint"]).name
    from npumoe.core.planning.costmodel import size

    table = Table("target", "build s", "peak private GB", "build wrote", "graphs", "stored in", "on disk",
                  "weights held", "×", "device fit (plan)", "top-1", "decode s/token",
                  title=f"npumoe bench scale --full: {name}, built and run whole on each target")
    for target, t in full["targets"].items():
        build, a, g = _step(full, f"build {target}"), t["artifacts"], t["agreement"]
        peak = max(s["peak_anon_bytes"] for s in full["steps"] if s["key"].endswith(f" {target}"))
        table.add_row(target, f"{build['seconds']:.0f}" + (" (resumed)" if t["build_resumed"] else ""),
                      f"{peak / 1e9:.2f}", size(build["written_bytes"]), str(a["graphs"]),
                      f"{a['units']} {a['unit_name']}", size(a["bytes_on_disk"]),
                      f"{size(a['weights_held_bytes'])} {a['precision']}", f"{a['of_weights']:.3f}",
                      fit_cell(t["fits"]), f"{g['agree']}/{g['of']}",
                      f"{t['decode_s_per_token']:.3g}" if t["decode_s_per_token"] else "-")
    console.print(table)
    steps = Table("command", "wall s", "peak private GB", "peak RSS GB", "written GB", title="each command")
    for r in full["steps"]:
        steps.add_row(r["key"], f"{r['seconds']:.1f}", f"{r['peak_anon_bytes'] / 1e9:.2f}",
                      f"{r['peak_rss_bytes'] / 1e9:.2f}", f"{r['written_bytes'] / 1e9:.2f}")
    console.print(steps)
    console.print("peak private = RssAnon, max over the target's plan, build and generate; weights held = each weight "
                  "the built graphs read, once, at the precision the backend stores; top-1 = the target's new tokens "
                  "that are the CPU reference's top-1 on the same tokens; decode on this machine's emulators (QNN's "
                  "x86_64 HTP, the MIL interpreter, OpenVINO's CPU device). "
                  + ("Builds kept in the work directory." if full["builds_kept"] else "Builds deleted once measured."))


def _step(full: dict, key: str) -> dict:
    return next(s for s in full["steps"] if s["key"] == key)
