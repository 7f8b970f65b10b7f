"""`npumoe bench export`: the native runner (`npumoe-run` on an exported program) against npumoe's Python engine on
the same model, plan and prompt: prefill and decode tokens/s, µs per layer per decode token, and each process's peak
anonymous memory, the runner's also against the KV cache and one layer's weights (the goal: at most 1.5× them, the
weights mapped from the program's file, not copied) (memory no file backs: a program whose weights stay mapped from its file keeps them out of it; smaps'
Private_* would count those clean file pages too, while this process alone maps them, so they are not the measure).
Rounds alternate the two, so a load change on a shared machine moves both."""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.bench.decode import bench_model_path, model_options
from npumoe.core.base.progress import task
from npumoe.models.checkpoints import LINEARS
from npumoe.models.demo import corpus

POLL_SECONDS = 0.005


def anonymous_bytes(pid: int) -> int | None:
    """The anonymous memory of a live process (Linux's smaps_rollup), None once it has gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Anonymous:"))


class PeakAnonymous:
    """The peak of a process's anonymous memory, polled on a thread while the ``with`` block runs."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def _poll(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, anonymous_bytes(self.pid) or 0)
            time.sleep(POLL_SECONDS)

    def __enter__(self):
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def run_native(directory: Path, ids: list[int], new: int) -> dict:
    """One run of the program's own runner, its peak anonymous memory polled."""
    process = subprocess.Popen([str(directory / "npumoe-run"), str(directory / "model.pte"), "--tokens",
                                ",".join(map(str, ids)), "--max-new-tokens", str(new), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
    with PeakAnonymous(process.pid) as peak:
        out, err = process.communicate()
    if process.returncode:
        raise click.ClickException(f"npumoe-run failed: {err.decode().strip()}")
    result = json.loads(out)
    return {"tokens": result["tokens"], "prefill_tok_s": result["prefill_tok_s"],
            "decode_tok_s": result["decode_tok_s"], "peak_anonymous_mb": peak.peak / 1e6}


def run_engine(engine, ids: list[int], new: int) -> dict:
    """The same generation on npumoe's engine in this process (its memory: Python, torch, npumoe and the model)."""
    import os

    with PeakAnonymous(os.getpid()) as peak:
        start = time.perf_counter()
        logits = engine.prefill_prompt(engine.check_generation(ids, new))
        prefilled = time.perf_counter()
        tokens = engine.continue_greedy(logits, new).tolist()
        done = time.perf_counter()
    return {"tokens": ids + tokens, "prefill_tok_s": len(ids) / (prefilled - start),
            "decode_tok_s": (len(tokens) - 1) / (done - prefilled) if len(tokens) > 1 else None,
            "peak_anonymous_mb": peak.peak / 1e6}


def measure(model, plan, directory: Path, ids: list[int], new: int, rounds: int, max_context: int) -> dict:
    """Alternating rounds of runner and engine; the median of each figure, and whether their tokens agree."""
    import statistics

    from npumoe.core.runtime.engine import Engine

    engine = Engine(model, plan=plan, max_context=max_context)
    run_engine(engine, ids, 2)  # warm: first calls build kernels and caches
    rows = {"npumoe-run": [], "engine": []}
    for _ in range(rounds):
        rows["npumoe-run"].append(run_native(directory, ids, new))
        rows["engine"].append(run_engine(engine, ids, new))
    layers = model.spec.num_layers
    result = {"model": model.name, "layers": layers, "prompt_tokens": len(ids), "new_tokens": new, "rounds": rounds,
              "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(rows["npumoe-run"], rows["engine"]))}
    for name, runs in rows.items():
        figures = {key: statistics.median(r[key] for r in runs)
                   for key in ("prefill_tok_s", "decode_tok_s", "peak_anonymous_mb")}
        figures["us_per_layer_decode_token"] = 1e6 / figures["decode_tok_s"] / layers
        figures["decode_tok_s_range"] = [min(r["decode_tok_s"] for r in runs), max(r["decode_tok_s"] for r in runs)]
        result[name] = figures
    return result


def memory_bound(model, max_context: int) -> dict:
    """The KV cache's bytes (fp32 keys and values of every layer) and layer 0's weights as the program stores them
    (packed matrices at their packed size, the rest fp32), in MB."""
    cache = sum(2 * ls.attention.num_kv_heads * max_context * max(ls.attention.head_dim, ls.attention.v_head_dim) * 4
                for ls in model.spec.layers)
    packed = getattr(model.weights, "packed", {})
    layer = sum(sum(b.numel() * b.element_size() for b in packed[n].buffers()) if n in packed
                else math.prod(model.weights.source(n).shape) * 4 for n in model.weights if n.startswith("layers.0."))
    return {"kv_cache_mb": cache / 1e6, "one_layer_mb": layer / 1e6}


def render(result: dict, console: Console) -> None:
    table = Table(title=f"npumoe-run against the engine, {result['model']} ({result['layers']} layers, "
                        f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new, "
                        f"median of {result['rounds']} rounds)")
    for col in ("", "prefill tok/s", "decode tok/s", "µs/layer/decode token", "peak anonymous MB"):
        table.add_column(col, justify="right")
    for name in ("npumoe-run", "engine"):
        r = result[name]
        table.add_row(name, f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.0f}",
                      f"{r['us_per_layer_decode_token']:.0f}", f"{r['peak_anonymous_mb']:.0f}")
    console.print(table)
    bound = result["kv_cache_mb"] + result["one_layer_mb"]
    console.print(f"npumoe-run's peak anonymous memory: {result['npumoe-run']['peak_anonymous_mb']:.0f} MB = "
                  f"{result['npumoe-run']['peak_anonymous_mb'] / bound:.2f}× the KV cache ({result['kv_cache_mb']:.0f}"
                  f" MB) + one layer ({result['one_layer_mb']:.0f} MB); goal ≤ 1.5×.")
    console.print(f"same tokens: {result['same_tokens']}; the engine's anonymous memory includes Python, torch and "
                  "npumoe; goal: npumoe-run not slower than the engine.")


@click.command("export")
@model_options(default_layers=1)
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="A plan (npumoe plan) for both; default none: every routed pair computed exactly.")
@click.option("--prompt-bytes", default=200, show_default=True, type=click.IntRange(1),
              help="Held-out demo text as the prompt, this many bytes (ids past the vocabulary dropped).")
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(2), help="New tokens a run.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Alternating rounds of each.")
@click.option("--chunk", default=64, show_default=True, type=click.IntRange(1), help="The program's prefill chunk.")
@click.option("--max-context", default=512, show_default=True, type=click.IntRange(2), help="KV cache length.")
@click.option("--bits", type=click.Choice(["2", "4"]), default=None,
              help="Quantise to this many bits first (npumoe quantize, into a scratch directory under $TMPDIR): the "
                   "program runs the packed matrices through npumoe's LUT kernels as custom ops.")
@click.option("--linears", type=click.Choice(list(LINEARS)), default="all", show_default=True,
              help="With --bits: the linears quantised (npumoe quantize --linears).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_export_command(model_name, layers, plan_path, prompt_bytes, tokens, rounds, chunk, max_context, bits,
                         linears, as_json):
    """npumoe-run against npumoe's engine on one cpu program: tokens/s, µs per layer, peak anonymous memory.

    \b
    Examples:
      npumoe bench export                                      # the demo model, no plan
      npumoe bench export --plan plan.json                     # the plan's static dispatch in both
      npumoe bench export --model olmoe-1b-7b --layers 1 --tokens 16 --rounds 1 --bits 4   # the memory check
    """
    from npumoe.core.planning.plan import Plan
    from npumoe.core.tools.export import export
    from npumoe.models.checkpoints.quantize import quantize_checkpoint
    from npumoe.models.loader import load

    plan = Plan.load(plan_path) if plan_path else None
    with tempfile.TemporaryDirectory() as scratch:
        source = bench_model_path(model_name, layers)
        if bits:
            with task(f"quantising to {bits} bits ({LINEARS[linears]})"):
                source = Path(scratch) / "quantised"
                quantize_checkpoint(load(bench_model_path(model_name, layers)).path, source, bits=int(bits),
                                    group=64, linears=linears, progress=False)
        with task("loading"):
            model = load(source, dtype="float32")
        text = corpus.heldout_texts(1)[0][:prompt_bytes]
        ids = [i for i in (model.tokenizer.encode(text) if model.tokenizer else range(1, prompt_bytes + 1))
               if i < model.spec.vocab_size]
        directory = Path(scratch) / "program"
        with task("exporting for cpu"):
            export(model, "cpu", directory, plan=plan, chunk=chunk, max_context=max_context)
        with task(f"{rounds} rounds of each"):
            result = measure(model, plan, directory, ids, tokens, rounds, max_context)
        result["model_pte_mb"] = (directory / "model.pte").stat().st_size / 1e6
        result.update(memory_bound(model, max_context), bits=bits and int(bits), linears=bits and linears)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
