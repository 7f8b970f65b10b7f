"""`npumoe bench prefetch`: how well the decode routing predictor names a layer's experts before its attention
runs, and what that would save when the experts do not all fit in memory.

Recall is measured: the predictor is fitted on the demo's calibration text and scored on its held-out text,
token by token as decode meets them. Time is modelled (no phone here): the held-out routing drives a
least-recently-used cache of experts holding ``--cache-share`` of them; a miss reads the expert from flash
before the layer can run, a predicted expert is read while the attention runs and costs only what outlasts it.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.base.progress import track

WINDOW = 512  # tokens per traced window
PREDICTORS = ("popularity", "early router", "fitted")


def token_windows(model, texts: list[str]) -> list[list[int]]:
    ids = [model.tokenizer.encode(t) for t in texts]
    return [t[s:s + WINDOW] for t in ids for s in range(0, len(t) - 16, WINDOW)]


def per_token(traces) -> list[tuple[int, object, object, object]]:
    """The traces split into single tokens (decode's view): (layer, x [1, H], previous [1, k] or None, experts [k])."""
    return [(layer, x[t:t + 1], None if prev is None else prev[t:t + 1], experts[t])
            for layer, x, prev, experts in traces for t in range(len(x))]


def predictions(model, calibration, held, budget: int) -> dict[str, list[list[int]]]:
    """Per held-out token and layer, each predictor's ``budget`` experts."""
    import numpy as np

    from npumoe.core.runtime.predictor import RoutingPredictor

    popular = {}
    for layer, _, _, experts in calibration:
        popular.setdefault(layer, np.zeros(model.spec.layers[layer].ffn.num_experts))
        np.add.at(popular[layer], experts.numpy().ravel(), 1)
    early, fitted = RoutingPredictor(model), RoutingPredictor(model).fit(calibration)
    return {
        "popularity": [np.argsort(-popular[layer], kind="stable")[:budget].tolist() for layer, *_ in held],
        "early router": [early.top(layer, x, budget) for layer, x, _, _ in held],
        "fitted": [fitted.top(layer, x, budget, prev) for layer, x, prev, _ in held],
    }


def modelled_ms(held, predicted: list[list[int]] | None, experts: int, cache_share: float, load_ms: float,
                attention_ms: float) -> float:
    """Modelled decode ms per token over the held-out routing: per layer its attention, plus the expert reads it
    waits for. Each layer keeps ``cache_share`` of its experts, least recently used evicted. While the attention
    runs, the predicted experts that are not resident are read, most likely first, as many as the attention's
    time allows (incremental preloading: the flash is otherwise idle then); after routing, every routed expert
    still missing is read before the layer goes on."""
    caches: dict[int, OrderedDict] = {}
    capacity, window = max(1, int(experts * cache_share)), int(attention_ms // load_ms) if load_ms else experts
    total = 0.0
    for n, (layer, _, _, routed) in enumerate(held):
        cache = caches.setdefault(layer, OrderedDict())

        def bring(e, prefetch: bool = False) -> None:
            if e not in cache and len(cache) >= capacity:
                cache.popitem(last=False)
            cache[e] = True
            cache.move_to_end(e, last=not prefetch)  # a guess is least recently used until used: the first to go

        for e in [e for e in (predicted[n] if predicted is not None else []) if e not in cache][:window]:
            bring(e, prefetch=True)
        missing = [e for e in routed.tolist() if e not in cache]
        for e in routed.tolist():
            bring(e)
        total += attention_ms + len(missing) * load_ms
    return total / sum(1 for h in held if h[0] == held[0][0])


def run(budgets: list[int], cache_share: float, expert_mb: float, flash_gb_s: float, attention_ms: float,
        texts: int) -> dict:
    import numpy as np

    from npumoe.bench.runtime_measure import demo_texts
    from npumoe.core.runtime.predictor import recall_at, routing_traces
    from npumoe.models.loader import load

    model = load()
    calibration_texts, heldout_texts = demo_texts()
    chunk = 256
    calibration = routing_traces(model, token_windows(model, calibration_texts[:texts]), chunk)
    held = per_token(routing_traces(model, token_windows(model, heldout_texts[:texts]), chunk))
    experts = model.spec.layers[held[0][0]].ffn.num_experts
    load_ms = expert_mb / 1e3 / flash_gb_s * 1e3
    timing = dict(experts=experts, cache_share=cache_share, load_ms=load_ms, attention_ms=attention_ms)
    result = {"held_out_tokens": sum(1 for h in held if h[0] == held[0][0]), "layers": len({h[0] for h in held}),
              "top_k": int(held[0][3].numel()), "model": {**timing, "expert_mb": expert_mb, "flash_gb_s": flash_gb_s},
              "all_resident_ms": attention_ms * len({h[0] for h in held}),
              "no_prefetch_ms": modelled_ms(held, None, **timing), "budgets": {}}
    for budget in track(budgets, "scoring the predictors", "budgets"):
        guesses = predictions(model, calibration, held, budget)
        result["budgets"][budget] = {
            name: {"recall": float(np.mean([recall_at(p, h[3]) for p, h in zip(guesses[name], held)])),
                   "modelled_ms": modelled_ms(held, guesses[name], **timing)} for name in PREDICTORS}
    return result


def render(r: dict, console: Console) -> None:
    t = Table(title=f"decode routing predictor, demo model, {r['held_out_tokens']} held-out tokens, top-{r['top_k']}")
    for col in ("preload", "predictor", "recall", "modelled ms/token", "saved vs no prefetch"):
        t.add_column(col, justify="right")
    for budget, rows in r["budgets"].items():
        for name, row in rows.items():
            saved = r["no_prefetch_ms"] - row["modelled_ms"]
            t.add_row(str(budget), name, f"{100 * row['recall']:.1f} %", f"{row['modelled_ms']:.2f}",
                      f"{saved:.2f} ms ({100 * saved / r['no_prefetch_ms']:.0f} %)")
    console.print(t)
    m = r["model"]
    console.print(f"modelled (not measured): {r['layers']} layers, a cache of {100 * m['cache_share']:.0f} % of each "
                  f"layer's {m['experts']} experts, {m['expert_mb']:g} MB an expert read at {m['flash_gb_s']:g} GB/s "
                  f"({m['load_ms']:.2f} ms), attention {m['attention_ms']:g} ms a layer. All experts resident: "
                  f"{r['all_resident_ms']:.2f} ms/token; no prefetch: {r['no_prefetch_ms']:.2f} ms/token.")


@click.command("prefetch")
@click.option("--preload", "budgets", default="2,4", show_default=True,
              help="Experts preloaded per layer and token (comma-separated budgets).")
@click.option("--cache-share", default=0.5, show_default=True, type=click.FloatRange(0.01, 1),
              help="Share of each layer's experts the modelled memory holds.")
@click.option("--expert-mb", default=3.1, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Bytes of one expert, MB (default: an OLMoE-1B-7B expert at 4 bits).")
@click.option("--flash-gb-s", default=4.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Modelled read rate from flash (UFS 4.0 reads about 4 GB/s).")
@click.option("--attention-ms", default=1.0, show_default=True, type=click.FloatRange(0),
              help="Modelled attention time per layer, during which predicted experts load.")
@click.option("--texts", default=8, show_default=True, type=click.IntRange(1, 24),
              help="Calibration and held-out documents (4 KB each) of the demo corpus.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_prefetch_command(budgets, cache_share, expert_mb, flash_gb_s, attention_ms, texts, as_json):
    """Decode routing predictor: recall at a preload budget (measured), decode time saved (modelled)."""
    try:
        preload = [int(b) for b in budgets.split(",")]
    except ValueError:
        preload = []
    if not preload or min(preload) < 1:
        raise click.BadParameter(f"{budgets!r} is not a comma-separated list of whole numbers ≥ 1, e.g. 2,4",
                                 param_hint="--preload")
    result = run(preload, cache_share, expert_mb, flash_gb_s, attention_ms, texts)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
