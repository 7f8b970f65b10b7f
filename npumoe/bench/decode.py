"""`npumoe bench decode`: where a decode step's time goes — executors (the graphs' own compute) versus
host work around them (routing, dispatch, rope and masks, cache writes, Python) — and the weight bytes
one token reads. The host share is what the runtime, not the device, costs: on a phone NPU whose whole
decode step takes a few ms, 100 µs of host work per layer is already most of it."""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.bench.scale import CACHE, MODELS, write_random_checkpoint
from npumoe.commands.options import dtype_option
from npumoe.core.base.progress import task

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
HOST_GOAL_US = 100  # per layer per decode token (issue 17)
DEMO_GOAL_TOK_S = 1000


def real_width_checkpoint(name: str, layers: int) -> Path:
    """The first ``layers`` layers of a real model's exact config, random bf16 weights, written once."""
    cfg = {**MODELS[name], "num_hidden_layers": layers}
    return write_random_checkpoint(cfg, CACHE / f"{name}-{layers}-layers")


def model_options(default_layers: int):
    """``--model`` (the demo or a real model's widths) and ``--layers``, as the benches that take either ask them;
    :func:`bench_model_path` turns them into what to load."""
    def decorate(f):
        f = click.option("--layers", default=default_layers, show_default=True, type=click.IntRange(1),
                         help="Layers of the real-width model (written once to the bench cache).")(f)
        return click.option("--model", "model_name", type=click.Choice(["demo", *MODELS]), default="demo",
                            show_default=True,
                            help="The shipped demo model, or a real model's exact widths with random bf16 weights.")(f)
    return decorate


def bench_model_path(model_name: str, layers: int) -> Path | None:
    """What :func:`model_options` chose, for ``npumoe.load`` (None: the demo)."""
    return None if model_name == "demo" else real_width_checkpoint(model_name, layers)


def host_inside_layers(spans: list[tuple[str, float, float]]) -> float:
    """Seconds inside the layers not spent in an executor: the host work a layer adds, apart from a step's own
    (embedding, the LM head's logits, sampling), which a 2-layer cut would otherwise split over 2 layers. A layer
    runs from its first timer (rope_mask) to its last (residual); a step through the fused stack is one span
    (layers) over all of them."""
    windows, opened = [], None
    for op, a, b in sorted(spans, key=lambda s: s[1]):
        if op == "layers":
            windows.append((a, b))
        elif op == "rope_mask" and opened is None:
            opened = a
        elif op == "residual" and opened is not None:
            windows.append((opened, b))
            opened = None
    starts = [a for a, _ in windows]
    host = sum(b - a for a, b in windows)
    for a, b in ((a, b) for op, a, b in spans if op == "executor"):  # each wholly inside one window, or outside all
        i = bisect.bisect_right(starts, a) - 1
        if i >= 0 and b <= windows[i][1]:
            host -= b - a
    return host


def measure(engine, tokens: int) -> dict:
    """Decode ``tokens`` tokens after a short prompt (``engine``: an :class:`~npumoe.core.runtime.engine.Engine`);
    host = wall time not spent inside executors."""
    import numpy as np

    ids = np.asarray(engine.model.tokenizer.encode(PROMPT) if engine.model.tokenizer else range(1, 33))
    ids = ids[ids < engine.spec.vocab_size]
    room = engine.cache.capacity - len(ids) - 1
    if tokens > room:
        raise click.BadParameter(f"{tokens} decode steps do not fit the {engine.cache.capacity}-slot KV cache after "
                                 f"the {len(ids) + 1}-token prompt; time at most {room}.", param_hint="--tokens")
    token = int(engine.generate(ids, max_new_tokens=1)[0])
    engine.metrics_.reset()
    engine.record_spans()
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode(token).argmax())
    wall = time.perf_counter() - start
    m = engine.metrics_
    executor = m.seconds["executor"]
    host_ops = {op: s / tokens * 1e6 for op, s in sorted(m.seconds.items(), key=lambda kv: -kv[1])
                if op not in ("decode", "executor")}
    layers = engine.spec.num_layers
    read = m.counts["weight_bytes"] / tokens
    in_layers = host_inside_layers(m.spans)
    return {
        "model": engine.model.name, "layers": layers, "tokens": tokens,
        "tokens_per_s": tokens / wall, "ms_per_token": wall / tokens * 1e3,
        "executor_ms_per_token": executor / tokens * 1e3,
        "host_us_per_layer_token": in_layers / tokens / layers * 1e6,
        "host_us_per_token_outside_layers": (wall - executor - in_layers) / tokens * 1e6,
        "weight_mb_per_token": read / 1e6,
        "graph_calls_per_token": sum(m.graph_runs.values()) / tokens,
        "timers_us_per_token": host_ops,  # nested: each includes the executor calls inside it
    }


def render(result: dict, console: Console) -> None:
    table = Table(title=f"decode, {result['model']} ({result['layers']} layers, {result['tokens']} tokens)")
    for col in ("tok/s", "ms/token", "executors ms", "host µs/layer", "host µs/token outside layers",
                "weight MB/token", "graph calls/token"):
        table.add_column(col, justify="right")
    table.add_row(f"{result['tokens_per_s']:.0f}", f"{result['ms_per_token']:.2f}",
                  f"{result['executor_ms_per_token']:.2f}", f"{result['host_us_per_layer_token']:.0f}",
                  f"{result['host_us_per_token_outside_layers']:.0f}", f"{result['weight_mb_per_token']:.1f}",
                  f"{result['graph_calls_per_token']:.0f}")
    console.print(table)
    console.print("timers, µs per token (each includes the executor calls inside it): " + ", ".join(
        f"{op} {us:.0f}" for op, us in result["timers_us_per_token"].items()))
    console.print(f"goals: host ≤ {HOST_GOAL_US} µs per layer per token; the demo model ≥ {DEMO_GOAL_TOK_S} tok/s "
                  "(CPU reference path). executors ms = time inside graph calls; host = the rest of the step: inside "
                  "the layers (routing, dispatch, rope and masks, cache writes), and the step's own (embedding, "
                  "the logits' checks and sampling, Python between layers).")


@click.command("decode")
@model_options(default_layers=2)
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(1), help="Decode steps to time.")
@dtype_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_decode_command(model_name, layers, tokens, dtype, as_json):
    """Decode tokens/s, host µs per layer per token, and weight bytes per token.

    \b
    Examples:
      npumoe bench decode                                  # the demo model, CPU reference path
      npumoe bench decode --model qwen3-30b-a3b --layers 2  # Qwen3-30B-A3B's widths, 2 of its 48 layers
      npumoe bench decode --model qwen3-30b-a3b --dtype bfloat16  # its weights read as stored (bf16 kernels)
    """
    from npumoe.core.runtime.engine import Engine
    from npumoe.models.loader import load

    with task("loading"):
        model = load(bench_model_path(model_name, layers), dtype=dtype)
        engine = Engine(model)
    with task(f"decoding {tokens} tokens"):
        result = measure(engine, tokens)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
