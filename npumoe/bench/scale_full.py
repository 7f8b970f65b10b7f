"""``npumoe bench scale --full``: the whole checkpoint calibrated, planned, built for the HTP and run end to end
through the built artifacts, each command in its own measured process.

The end-to-end check is top-1 agreement on the same tokens: the CPU reference (the checkpoint's bf16 through
npumoe's own engine, no plan) reads the prompt plus the HTP's new tokens, and each of its next-token argmaxes
is compared with the token the HTP picked there. Comparing two free-running generations would count every token
after a first difference as a disagreement.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

PROMPT_TOKENS, NEW_TOKENS = 64, 8
TARGET = "htp"


def prompt_ids(text: Path) -> list[int]:
    """The first ``PROMPT_TOKENS`` bytes of the calibration text (the bench checkpoints have a byte tokenizer)."""
    return list(text.read_bytes()[:PROMPT_TOKENS])


def run_full(ckpt: Path, work: Path, console: Console, measure) -> dict:
    """Each command as a user runs it on the whole ``ckpt``, measured; the built artifacts' figures and the
    end-to-end agreement."""
    model, text = ["--model", str(ckpt)], work / "calibration.txt"
    build, plan = work / f"build-{TARGET}", work / f"plan-{TARGET}.json"
    ids = prompt_ids(text)
    cold = {**os.environ, "NPUMOE_BUILD_CACHE": str(work / "build-cache")}  # compiled here (and deleted with it), not found in yours
    runs = {
        "calibrate": ["calibrate", *model, "--dtype", "bfloat16", "--text", str(text), "--chunk", "256",
                      "--out", str(work / "profile.json")],
        "plan": ["plan", *model, "--profile", str(work / "profile.json"), "--target", TARGET, "--residency", "npu",
                 "--out", str(plan)],
        "build": ["build", *model, "--plan", str(plan), "--target", TARGET, "--out", str(build)],
        "generate": ["generate", *model, "--plan", str(plan), "--target", TARGET, "--artifacts", str(build),
                     "--ids", ",".join(map(str, ids)), "-n", str(NEW_TOKENS)],
    }
    steps = []
    for step, argv in runs.items():
        console.print(f"[dim]npumoe {' '.join(argv)[:160]}[/dim]")
        steps.append({"step": f"{step} (whole model, {TARGET})", **measure(argv, cold if step == "build" else None)})
    new = [int(t) for t in steps[-1].pop("stdout").split()]
    return {"steps": steps, "artifacts": artifact_figures(ckpt, build),
            "agreement": agreement(ckpt, ids, new), "decode_s_per_token": seconds_per_token(steps[-1]["summary"])}


def artifact_figures(ckpt: Path, build: Path) -> dict:
    """Graphs (one QNN context each), bytes on disk, and the weights those graphs hold at fp16."""
    from npumoe.core.compiler.artifacts import target_directory
    from npumoe.core.compiler.program import build_program
    from npumoe.core.ir.weights import expected_shapes
    from npumoe.core.planning.plan import Plan
    from npumoe.models.loader import config_spec, read_config

    out = target_directory(build, TARGET)
    manifest = json.loads((out / "manifest.json").read_text())
    spec = config_spec(read_config(ckpt))[1]
    shapes = expected_shapes(spec) | {"lm_head.weight": (spec.vocab_size, spec.hidden_size)}
    plan = Plan.from_json(manifest["plan"])
    program = build_program(spec, chunk=plan.chunk, max_context=manifest["max_context"], plan=plan)
    held = {n for name in manifest["graphs"] for n in program.graphs[name].weight_names()}
    unique = 2 * sum(int(np.prod(shapes[n])) for n in held)
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"graphs": len(manifest["graphs"]), "contexts": len(manifest["graphs"]), "bytes_on_disk": on_disk,
            "fp16_weights_held": unique, "of_weights": on_disk / unique}


def agreement(ckpt: Path, prompt: list[int], new: list[int]) -> dict:
    """How many of the HTP's new tokens are the CPU reference's top-1 on the same preceding tokens."""
    import npumoe

    reference = npumoe.Engine(npumoe.load(ckpt, dtype="bfloat16"))
    logits = reference.forward(np.asarray(prompt + new[:-1]))
    picked = logits[len(prompt) - 1:].argmax(axis=-1).tolist()
    return {"tokens": new, "reference_top1": picked, "agree": sum(a == b for a, b in zip(new, picked)),
            "of": len(new)}


def seconds_per_token(summary: str) -> float | None:
    found = re.search(r"decode ([0-9.e+-]+) s/token", summary)
    return float(found.group(1)) if found else None


def print_full(result: dict, console: Console) -> None:
    table = Table("command", "wall s", "peak private GB", "peak RSS GB", "written GB",
                  title=f"npumoe bench scale --full: {Path(result['checkpoint']).name} on the {TARGET}")
    for r in result["full"]["steps"]:
        table.add_row(r["step"], f"{r['seconds']:.1f}", f"{r['peak_anon_bytes'] / 1e9:.2f}",
                      f"{r['peak_rss_bytes'] / 1e9:.2f}", f"{r['written_bytes'] / 1e9:.2f}")
    console.print(table)
    full, a = result["full"], result["full"]["artifacts"]
    g = full["agreement"]
    console.print(f"artifacts: {a['graphs']} graphs in {a['contexts']} QNN contexts, {a['bytes_on_disk'] / 1e9:.2f} GB "
                  f"on disk for the {a['fp16_weights_held'] / 1e9:.2f} GB of fp16 weights they read ({a['of_weights']:.3f}x)")
    per_token = f"{full['decode_s_per_token']:.3g} s" if full["decode_s_per_token"] else "-"
    console.print(f"end to end: {g['agree']}/{g['of']} new tokens are the CPU reference's top-1 on the same "
                  f"tokens; decode {per_token} a token on QNN's x86_64 HTP")
