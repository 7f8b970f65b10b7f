"""`npumoe bench mlx`: npumoe's mlx target beside mlx-lm, the engine a Mac user already runs, on one model in one
run: decode and prefill tokens/s and their ratio.

The model has Qwen3-30B-A3B's layer widths (hidden 2048, top-8 experts 768 wide, 32/4 heads × 128) but 32 experts,
2 layers and an 8,192-token vocabulary, random bf16 weights written once to the bench cache (1.5 GB in fp32, so
that both engines fit beside each other, and beside anything else, on a 24 GB machine). Both engines hold its
weights and compute in one dtype: bf16 on the GPU, fp32 on MLX's CPU backend (whose gather_mm, which mlx-lm's
experts run on, takes fp32 only). mlx-lm loads the checkpoint with its own loader; npumoe builds the mlx target
from it once (``--activations`` that dtype, every expert group on MLX) into the bench cache beside it. Rounds
interleave the engines: npumoe's engine decoding greedily, then mlx-lm's ``generate_step`` (its decode loop, as
``mlx_lm.generate`` runs it), and so on; the medians and their ratio are printed. On Linux both run on MLX's CPU
backend; only a Mac gives the GPU's figures.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from npumoe.bench.cpu import verdict
from npumoe.bench.scale import CACHE, QWEN3_30B_A3B, write_random_checkpoint
from npumoe.core.base.errors import BackendUnavailableError

CONFIG = {**QWEN3_30B_A3B, "num_experts": 32, "num_hidden_layers": 2, "vocab_size": 8192, "bos_token_id": 1,
          "eos_token_id": 2}
CHECKPOINT = CACHE / "qwen3-30b-a3b-widths-32-experts-2-layers-vocab8192"
MAX_CONTEXT = 512
GOAL = 1.0  # npumoe decode tok/s ÷ mlx-lm's on the same device (the goal on the CPU backend)
WARMUP_ROUNDS = 1
MLX_LM_MISSING = "bench mlx needs mlx and mlx-lm: pip install 'npumoe[mlx]' (Python 3.11+)"


@dataclass
class Row:
    engine: str
    decode_tok_s: float  # medians of the rounds
    prefill_tok_s: float
    decode_rounds: list[float] = field(default_factory=list)  # tok/s, round by round
    prefill_rounds: list[float] = field(default_factory=list)


class NpumoeRunner:
    """npumoe's engine on the mlx target, built once from the checkpoint."""

    def __init__(self, checkpoint: Path, dtype: str):
        import npumoe
        from npumoe.core.compiler.artifacts import build

        model = npumoe.load(checkpoint, dtype=dtype)
        artifacts = checkpoint.with_name(f"{checkpoint.name}-mlx-{dtype}")
        if not (artifacts / "manifest.json").is_file():
            calibration = np.random.default_rng(1).integers(3, CONFIG["vocab_size"], 512).tolist()
            profile = npumoe.calibrate(model, [calibration], chunk=64)
            plan = npumoe.plan(model, profile, target="mlx", residency="npu")
            build(model, plan, "mlx", artifacts, max_context=MAX_CONTEXT, progress=False, activations=dtype)
        self.engine = npumoe.Engine(model, backend="mlx", artifacts=artifacts)

    def prefill(self, ids: np.ndarray) -> int:
        return int(self.engine.generate(ids, max_new_tokens=1)[0])

    def decode(self, ids: np.ndarray, tokens: int) -> float:
        token = self.prefill(ids)
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(self.engine.decode(token).argmax())
        return tokens / (time.perf_counter() - start)


class MlxLmRunner:
    """mlx-lm's model of the checkpoint (its loader, in ``dtype``) and its decode loop."""

    def __init__(self, checkpoint: Path, dtype: str):
        import mlx.core as mx
        from mlx_lm.utils import load_model

        self.model, _ = load_model(checkpoint)
        self.model.set_dtype(getattr(mx, dtype))

    def prefill(self, ids: np.ndarray) -> int:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        logits = self.model(mx.array(ids)[None], cache=make_prompt_cache(self.model))
        return int(mx.argmax(logits[0, -1]).item())

    def decode(self, ids: np.ndarray, tokens: int) -> float:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array(ids), self.model, max_tokens=tokens + 1)
        next(steps)  # the prompt and the first token: not timed
        start = time.perf_counter()
        for _ in steps:
            pass
        return tokens / (time.perf_counter() - start)


def run(console: Console, rounds: int, prefill_tokens: int, decode_tokens: int) -> list[Row]:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(f"{MLX_LM_MISSING} ({err}).") from err
    with console.status("writing the model (once)"):
        checkpoint = write_random_checkpoint(CONFIG, CHECKPOINT, progress=False)
    with console.status("building npumoe's mlx target (once) and loading both engines"):
        runners = {"npumoe mlx": NpumoeRunner(checkpoint, dtype()), "mlx-lm": MlxLmRunner(checkpoint, dtype())}
    rng = np.random.default_rng(0)
    prompt, short = rng.integers(3, CONFIG["vocab_size"], prefill_tokens), rng.integers(3, CONFIG["vocab_size"], 16)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runners}
    for r in range(1 - WARMUP_ROUNDS, rounds + 1):  # rounds up to 0 warm up, untimed
        for name, runner in runners.items():
            with console.status(f"round {r}/{rounds}: {name}" if r > 0 else f"warming up {name}"):
                start = time.perf_counter()
                runner.prefill(prompt)
                prefill = prefill_tokens / (time.perf_counter() - start)
                decode = runner.decode(short, decode_tokens)
            if r > 0:
                times[name][0].append(decode)
                times[name][1].append(prefill)
    return [Row(name, statistics.median(dec), statistics.median(pre), dec, pre) for name, (dec, pre) in times.items()]


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def device() -> str:
    return "the GPU" if on_gpu() else "MLX's CPU backend"


def dtype() -> str:
    """What both engines compute in: bf16 on the GPU; fp32 on the CPU backend, whose gather_mm takes nothing else."""
    return "bfloat16" if on_gpu() else "float32"


def ratio_line(rows: list[Row]) -> str:
    ours, theirs = rows
    decode = verdict(ours.decode_tok_s / theirs.decode_tok_s, ours.decode_rounds, theirs.decode_rounds, GOAL)
    return f"npumoe mlx / mlx-lm: decode {decode}, prefill {ours.prefill_tok_s / theirs.prefill_tok_s:.2f}×"


def render(rows: list[Row], console: Console) -> None:
    table = Table(title=f"{dtype()} decode and prefill on {device()}, Qwen3-30B-A3B widths (32 experts, 2 layers, "
                        "vocab 8192), medians of interleaved rounds")
    for col in ("engine", "decode tok/s", "prefill tok/s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for row in rows:
        table.add_row(row.engine, f"{row.decode_tok_s:.1f}", f"{row.prefill_tok_s:.1f}")
    console.print(table)
    console.print(ratio_line(rows))


@click.command("mlx")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Interleaved rounds (medians).")
@click.option("--prefill", "prefill_tokens", default=128, show_default=True, type=click.IntRange(16, 448),
              help="Prompt tokens timed for prefill.")
@click.option("--decode", "decode_tokens", default=32, show_default=True, type=click.IntRange(1, 448),
              help="Decode steps timed per round.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_mlx_command(rounds, prefill_tokens, decode_tokens, as_json):
    """npumoe's mlx target against mlx-lm on one model: decode and prefill tokens/s and their ratio.

    Both on MLX's default device, in bf16 on a Mac's GPU and fp32 on MLX's CPU backend, interleaved in one
    process. Needs mlx and mlx-lm (pip install 'npumoe[mlx]'). The model (0.8 GB) and npumoe's build of it are
    written once to the bench cache.

    \b
    Examples:
      npumoe bench mlx
      npumoe bench mlx --rounds 5 --json
    """
    console = Console(stderr=as_json)
    rows = run(console, rounds, prefill_tokens, decode_tokens)
    if as_json:
        click.echo(json.dumps({"device": device(), "dtype": dtype(), "rows": [asdict(r) for r in rows],
                               "decode_ratio": rows[0].decode_tok_s / rows[1].decode_tok_s}, indent=1))
    else:
        render(rows, console)
