"""`npumoe generate` and `npumoe demo`."""

from __future__ import annotations

import time

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from npumoe.core.calibrate import LoadRecorder, imbalance
from npumoe.core.runtime.engine import DEFAULT_CHUNK, Engine
from npumoe.errors import InputError
from npumoe.models.loader import DEMO_DIR, load

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


def model_option(f):
    return click.option(
        "--model", "model_dir", default=str(DEMO_DIR), show_default="the shipped demo model", type=click.Path(),
        help="Hugging Face checkpoint directory (config.json + *.safetensors).",
    )(f)


@click.command("generate")
@model_option
@click.option("--prompt", default=DEMO_PROMPT, show_default=True, help="Text to continue.")
@click.option("--ids", default=None, help="Token ids instead of text, e.g. '1,2,3' (for models without a tokenizer).")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(1), help="Tokens to generate.")
@click.option("--chunk", default=DEFAULT_CHUNK, show_default=True, type=click.IntRange(1), help="Prefill chunk size (static graph length).")
@click.option("--max-context", default=None, type=click.IntRange(1), help="KV cache length [default: min(model max, 512)].")
@click.option("--plan", "plan_path", default=None, type=click.Path(), help="Run under a plan (npumoe plan --out).")
@click.option("--target", type=click.Choice(["cpu", "htp", "ane"]), default="cpu", show_default=True,
              help="Where NPU-placed graphs run; htp/ane need --artifacts from npumoe build.")
@click.option("--artifacts", default=None, type=click.Path(), help="Artifact directory from npumoe build.")
def generate_command(model_dir, prompt, ids, max_new_tokens, chunk, max_context, plan_path, target, artifacts):
    """Greedy-generate a continuation, through npumoe's own graphs and host runtime.

    \b
    Examples:
      npumoe generate --prompt "import os" -n 40
      npumoe generate --target htp --artifacts build/htp
    """
    from npumoe.core.plan import Plan

    model = load(model_dir)
    tokens = prompt_ids(model, prompt, ids)
    plan = Plan.load(plan_path) if plan_path else None
    eng = Engine(model, plan=plan, backend=target, artifacts=artifacts, chunk=chunk, max_context=max_context)
    start = time.perf_counter()
    new = eng.generate(np.asarray(tokens), max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    text = model.tokenizer.decode(new) if ids is None else " ".join(map(str, new.tolist()))
    click.echo(text)
    click.echo(f"[{len(tokens)} prompt + {len(new)} new tokens in {seconds:.2f} s]", err=True)


def routing_table(spec, recorder: LoadRecorder) -> Table:
    table = Table("layer", "tokens per expert", "r = max/mean", "hottest")
    for layer in spec.moe_layers:
        loads = recorder.matrix(layer)
        total = loads.sum(axis=0)
        hottest = ", ".join(f"e{e}" for e in np.argsort(-total)[:3])
        table.add_row(str(layer), " ".join(f"{int(c):3d}" for c in total), f"{imbalance(loads):.2f}", hottest)
    return table


@click.command("demo")
@click.option("--prompt", default=DEMO_PROMPT, show_default=True, help="Text for the demo model to continue.")
@click.option("--max-new-tokens", "-n", default=48, show_default=True, type=click.IntRange(1))
def demo_command(prompt, max_new_tokens):
    """The main job on the embedded demo model: load it, generate, and show how it routes."""
    console = Console()
    model = load()
    if not prompt:
        raise InputError("the prompt is empty; pass --prompt TEXT.")
    spec = model.spec
    console.print(
        f"[bold]npumoe demo[/bold]: {spec.family} byte-level LM, {spec.num_layers} layers, "
        f"{spec.layers[spec.moe_layers[0]].ffn.num_experts} experts top-{spec.layers[spec.moe_layers[0]].ffn.top_k}"
    )
    recorder = LoadRecorder(spec)
    eng = Engine(model, on_route=recorder)
    tokens = model.tokenizer.encode(prompt)
    start = time.perf_counter()
    new = eng.generate(np.asarray(tokens), max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    console.print("[dim]prompt:[/dim] " + repr(prompt))
    console.print("[dim]output:[/dim] " + repr(model.tokenizer.decode(new)))
    console.print(f"{len(tokens)} prompt + {len(new)} new tokens in {seconds:.2f} s on the CPU reference path")
    console.print(routing_table(spec, recorder))
    m = eng.metrics
    console.print(
        f"routed {m['routed']} token-slots, graph launches {m['cpu_launches'] + m['npu_launches']}; "
        f"host time: router {m['seconds'].get('router', 0) * 1e3:.1f} ms, "
        f"gather {m['seconds'].get('gather', 0) * 1e3:.1f} ms, scatter {m['seconds'].get('scatter', 0) * 1e3:.1f} ms"
    )
