"""`npumoe generate` and `npumoe demo`."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.commands.options import dtype_option, model_option, target_option
from npumoe.core.base.errors import InputError
from npumoe.core.base.outputs import claim
from npumoe.core.runtime import DEFAULT_CHUNK

DEMO_PROMPT = "def fibonacci(n):\n    "


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as err:
        raise InputError(f"--ids takes integers separated by commas or spaces, got {text!r}.") from err


def prompt_ids(model, prompt: str | None, ids: str | None) -> list[int]:
    if ids is not None:
        return parse_ids(ids)
    if not prompt:
        raise InputError("the prompt is empty; pass --prompt TEXT (or --ids 1,2,3).")
    return model.tokenizer.encode(prompt)


@click.command("generate")
@model_option
@dtype_option
@click.option("--prompt", default=DEMO_PROMPT, show_default=True, help="Text to continue.")
@click.option("--ids", default=None, help="Token ids instead of text, e.g. '1,2,3' (for models without a tokenizer).")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(1),
              help="Tokens to generate.")
@click.option("--chunk", default=DEFAULT_CHUNK, show_default=True, type=click.IntRange(1),
              help="Prefill chunk size (static graph length).")
@click.option("--max-context", default=None, type=click.IntRange(1),
              help="KV cache length [default: min(model max, 512)].")
@click.option("--plan", "plan_path", default=None, type=click.Path(), help="Run under a plan (npumoe plan --out).")
@target_option("cpu", "Where NPU-placed graphs run; an NPU target needs --artifacts from npumoe build.")
@click.option("--artifacts", default=None, type=click.Path(), help="Artifact directory from npumoe build.")
@click.option("--max-resident-mb", default=None, type=click.FloatRange(0),
              help="Keep at most this many MB of graphs loaded (least recently used evicted first); before each MoE "
                   "layer's attention, its router prefetches the experts it expects. Default: every graph, or as many "
                   "as the device holds and the rest on demand.")
@click.option("--trace", "trace_path", default=None, type=click.Path(),
              help="Write a Chrome trace of host steps (and, for htp, the HTP's per-graph profile) here.")
@click.option("--prefill-on", default=None,
              help="Disaggregated: run the prompt on this target (e.g. ane, htp; with --decode-on, instead of "
                   "--target), then hand its KV cache over once.")
@click.option("--decode-on", default=None,
              help="Disaggregated: decode on this target (e.g. mlx, cpu) from the cache --prefill-on filled. "
                   "--artifacts is a build of every non-CPU target named (npumoe build --targets ane,mlx).")
def generate_command(model_dir, dtype, prompt, ids, max_new_tokens, chunk, max_context, plan_path, target, artifacts,
                     max_resident_mb, trace_path, prefill_on, decode_on):
    """Greedy-generate a continuation, through npumoe's own graphs and host runtime.

    \b
    Examples:
      npumoe generate --prompt "import os" -n 40
      npumoe generate --target htp --artifacts build/htp --trace trace.json
      npumoe generate --artifacts build --prefill-on ane --decode-on mlx --trace trace.json
    """
    import numpy as np

    from npumoe.core.planning.plan import Plan
    from npumoe.core.runtime.predictor import RoutingPredictor
    from npumoe.models.loader import load

    split = disaggregation(prefill_on, decode_on, target, plan_path, max_resident_mb)
    profiler = None
    if trace_path:
        from npumoe.core.tools.trace import TRACE, device_trace

        claim(trace_path, TRACE, "--trace")
        profiler = device_trace(prefill_on or target)
    model = load(model_dir, dtype=dtype)
    tokens = prompt_ids(model, prompt, ids)
    profile = profiler.backend_options(Path(trace_path)) if profiler else None
    budget = {} if max_resident_mb is None else {"max_resident_bytes": int(max_resident_mb * 1e6),
                                                 "predictor": RoutingPredictor(model)}
    if split:
        from npumoe.core.runtime.disaggregated import DisaggregatedEngine

        eng = DisaggregatedEngine(model, prefill_on, decode_on, artifacts, chunk=chunk, max_context=max_context,
                                  prefill_options=profile)
    else:
        from npumoe.core.runtime.engine import Engine

        plan = Plan.load(plan_path) if plan_path else None
        eng = Engine(model, plan=plan, backend=target, artifacts=artifacts, chunk=chunk, max_context=max_context,
                     backend_options=profile, **budget)
    if trace_path:
        eng.record_spans()
    start = time.perf_counter()
    new = eng.generate(np.asarray(tokens), max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    text = model.tokenizer.decode(new) if ids is None else " ".join(map(str, new.tolist()))
    click.echo(text)
    timed = eng.metrics["seconds"]
    steps = len(new) - 1  # the first new token comes from the prefill's logits
    decode = (f", decode setup {timed.get('decode_setup', 0.0):.3g} s, decode {timed['decode'] / steps:.3g} s/token "
              f"({steps / timed['decode']:.3g} tok/s)") if steps else ""
    handoff = (f", hand-off {prefill_on} -> {decode_on} {timed['handoff']:.3g} s "
               f"({eng.metrics['handoff_bytes'] / 1e6:.3g} MB from the {eng.last_handoff.source})") if split else ""
    click.echo(f"[{len(tokens)} prompt + {len(new)} new tokens in {seconds:.2f} s: prefill {timed['prefill']:.3g} s "
               f"({len(tokens) / timed['prefill']:.3g} tok/s){handoff}{decode}]", err=True)
    if budget:
        m = eng.metrics
        asked = m["executor_hits"] + m["executor_misses"]
        click.echo(f"[graphs within {max_resident_mb:g} MB: {m['executor_misses']} loads on demand, {m['prefetches']} "
                   f"prefetched, {m['evictions']} evicted, {100 * m['executor_hits'] / max(asked, 1):.0f} % of calls "
                   f"found their graph loaded; the router one attention early named {m['predicted_hits']} of "
                   f"{m['routed_experts']} routed experts]", err=True)
    if trace_path:
        from npumoe.core.tools.trace import write_trace

        click.echo(f"wrote {write_trace(trace_path, eng, profiler, eng.prefill if split else eng)}", err=True)


def disaggregation(prefill_on, decode_on, target, plan_path, max_resident_mb) -> bool:
    """Are --prefill-on and --decode-on given (both, and without the options of a one-target run)?"""
    if prefill_on is None and decode_on is None:
        return False
    if prefill_on is None or decode_on is None:
        given, missing = ("--prefill-on", "--decode-on") if decode_on is None else ("--decode-on", "--prefill-on")
        raise InputError(f"{given} needs {missing} too: name where the prompt runs and where decode runs.")
    for option, value, unset in (("--target", target, "cpu"), ("--plan", plan_path, None),
                                 ("--max-resident-mb", max_resident_mb, None)):
        if value != unset:
            raise InputError(f"{option} applies to a one-target run; with --prefill-on and --decode-on each target "
                             "runs its own build from --artifacts.")
    return True


def routing_table(spec, recorder) -> Table:
    """Per MoE layer, every routed token-slot of the run (prefill and decode) per expert (``recorder``: a
    :class:`~npumoe.core.planning.profile.LoadRecorder`)."""
    import numpy as np

    table = Table("layer", "token-slots per expert", "max/mean", "hottest")
    for layer in spec.moe_layers:
        total = recorder.matrix(layer).sum(axis=0)
        hottest = ", ".join(f"e{e}" for e in np.argsort(-total)[:3])
        table.add_row(str(layer), " ".join(f"{int(c):3d}" for c in total), f"{total.max() / total.mean():.2f}", hottest)
    return table


def plan_table(model, profile, targets=None) -> Table:
    """One plan per target (default: every installed one) from the same profile: shapes, groups and what the
    planner predicts."""
    from npumoe.core.ir.backend import plugins
    from npumoe.core.planning.plan import plan

    table = Table("target", "rows per shape (first MoE layer)", "groups", "on NPU", "padded %", "overflow %",
                  title=f"plans from one routing profile (chunk {profile.chunk}, overflow spill, residency auto)")
    for target in targets or plugins():
        p = plan(model, profile, target=target)
        first = p.layers[min(p.layers)]
        groups = [g for lp in p.layers.values() for g in lp.groups]
        rows = ", ".join("/".join(str(sum(s)) for s in g.shapes) for g in first.groups if g.shapes) or "- (CPU)"
        table.add_row(target, rows, str(len(groups)), str(sum(g.residency == "npu" for g in groups)),
                      f"{p.predicted['padded_pct']:.1f}", f"{p.predicted['overflow_pct']:.1f}")
    return table


@click.command("demo")
@click.option("--prompt", default=DEMO_PROMPT, show_default=True, help="Text for the demo model to continue.")
@click.option("--max-new-tokens", "-n", default=48, show_default=True, type=click.IntRange(1))
@click.option("--calibration-texts", default=12, show_default=True, type=click.IntRange(1),
              help="Documents of the demo corpus's training split to calibrate on (first 2 KB of each).")
@click.option("--out", default="npumoe-demo", show_default=True, type=click.Path(),
              help="Where step 5 writes every target's artifacts, manifest.json and report.html.")
def demo_command(prompt, max_new_tokens, calibration_texts, out):
    """The main job on the embedded demo model: generate, calibrate, plan for every target, check the
    planned static-shape runtime against the reference, then build every installed NPU target and
    compare them.

    \b
    Steps:
      1. generate from --prompt on the fp32 reference path, with per-layer routing counts;
      2. calibrate expert loads on training-split text in 64-token prefill chunks;
      3. plan expert groups, their capacity shapes and residency for cpu, htp and ane;
      4. prefill held-out text with every expert group forced onto static NPU-shaped buffers
         (the htp plan, overflow spilled to the CPU path) and compare logits and generated
         tokens with the reference;
      5. build htp and ane (each installed target) from that one calibration, run each target's saved
         artifacts (QNN's HTP emulator, the MIL interpreter) on held-out text, and print the
         cross-vendor comparison; --out gets the artifacts and report.html.
    """
    import numpy as np

    from npumoe.core.planning.plan import plan
    from npumoe.core.planning.profile import LoadRecorder
    from npumoe.core.runtime.calibrate import calibrate
    from npumoe.core.runtime.engine import Engine
    from npumoe.core.tools.targets import TARGETS
    from npumoe.models.demo import corpus
    from npumoe.models.loader import load

    console = Console()
    claim(out, TARGETS)
    model = load()
    if not prompt:
        raise InputError("the prompt is empty; pass --prompt TEXT.")
    spec = model.spec
    moe = spec.layers[spec.moe_layers[0]].ffn
    console.print(f"[bold]npumoe demo[/bold]: {spec.family} byte-level LM, {spec.num_layers} layers, "
                  f"{moe.num_experts} experts top-{moe.top_k}")
    recorder = LoadRecorder(spec)
    reference = Engine(model, on_route=recorder)
    tokens = np.asarray(model.tokenizer.encode(prompt))
    start = time.perf_counter()
    new = reference.generate(tokens, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    console.print("[dim]prompt:[/dim] " + repr(prompt))
    console.print("[dim]output:[/dim] " + repr(model.tokenizer.decode(new)))
    console.print(f"{len(tokens)} prompt + {len(new)} new tokens in {seconds:.2f} s on the CPU reference path")
    console.print(routing_table(spec, recorder))

    texts = [t[:2048] for t in corpus.calibration_texts(calibration_texts)]
    profile = calibrate(model, texts, chunk=64, window=512)
    console.print(plan_table(model, profile))
    console.print("[dim]groups: static expert-group graphs per layer; on NPU: those placed on the NPU; padded %: "
                  "predicted share of NPU expert slots that are padding; overflow %: predicted share of routed "
                  "token-slots past their group's capacity (spilled to the CPU path)[/dim]")

    forced = plan(model, profile, target="htp", residency="npu")
    planned = Engine(model, plan=forced)
    held = np.asarray(model.tokenizer.encode(corpus.heldout_texts(1)[0])[:256])
    gap = float(np.abs(planned.forward(held) - Engine(model).forward(held)).max())
    m = planned.metrics
    npu = m["routed"] - m["spilled"] - m["dropped"]
    console.print(
        f"htp plan, all {sum(len(lp.groups) for lp in forced.layers.values())} groups on static NPU buffers, "
        f"{len(held)} held-out tokens: {npu}/{m['routed']} routed token-slots on the NPU graphs, "
        f"{m['spilled']} spilled to the CPU path, {m['dropped']} dropped, "
        f"{100 * m['padded'] / max(npu + m['padded'], 1):.1f} % of NPU slots padding; "
        f"max |Δlogit| vs reference {gap:.1e}"
    )
    same = np.array_equal(planned.generate(tokens, max_new_tokens=max_new_tokens), new)
    console.print("generated tokens under the plan: " + ("[green]identical to the reference[/green]" if same
                                                         else "[red]differ from the reference[/red]"))
    if not same or gap > 1e-4:
        raise SystemExit(1)
    every_target(model, profile, held, out, console)


def every_target(model, profile, held, out: str, console: Console) -> None:
    """Step 5: every installed NPU target from the one profile, run from its saved artifacts, compared."""
    from npumoe.commands.compare import render
    from npumoe.core.tools.compare import compare
    from npumoe.core.tools.report import write_html
    from npumoe.core.tools.targets import build_targets, installed_npu_targets

    targets, missing = installed_npu_targets()
    for name, why in missing.items():
        console.print(f"[yellow]{name} skipped[/yellow]: {why}")
    if not targets:
        console.print("no NPU toolchain is installed, so nothing was built: pip install 'npumoe[demo]'.")
        return
    console.print(f"building {', '.join(targets)} from the same profile and validating each on held-out text")
    build_targets(model, targets, {}, held, out, chunk=profile.chunk, residency="npu", profile=profile,
                  report=lambda line: console.print(f"[dim]{line}[/dim]"))
    result = compare(out)
    render(result, console)
    console.print(f"wrote {out} and {write_html(result, out, Path(out) / 'report.html')}")
