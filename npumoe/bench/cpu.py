"""`npumoe bench cpu`: npumoe's CPU path against llama.cpp, the engine a user would otherwise pick, on one
model in one run.

The model has Qwen3-30B-A3B's layer widths (hidden 2048, 128 experts, top-8, expert width 768, 32/4
heads × 128) with random bf16 weights, 2 layers and an 8,192-token vocabulary; it is written once to the
bench cache with its low-bit copies (``npumoe quantize``) and GGUF files (F16 from :mod:`npumoe.models.
gguf_export`, Q4_0 and Q2_K by llama.cpp's own quantiser). Each format pair is timed in interleaved
rounds (npumoe, then llama.cpp, then the next pair …) and the medians are printed, with the weight bytes
one decode token reads and the bandwidth that implies against the machine's measured read bandwidth.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from npumoe.bench.scale import CACHE, QWEN3_30B_A3B, mapped_reader, write_random_checkpoint
from npumoe.bench.weight_bytes import npumoe_decode_bytes
from npumoe.core.base.native import native_output_silenced
from npumoe.core.base.progress import task

CONFIG = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "vocab_size": 8192, "bos_token_id": 1, "eos_token_id": 2}
CHECKPOINT = CACHE / "qwen3-30b-a3b-2-layers-vocab8192"
GGUF_DIR = CACHE / "qwen3-30b-a3b-2-layers-vocab8192-gguf"  # beside, not inside: quantize copies a checkpoint's files
# npumoe format → (quantize bits or None for the stored bf16, the llama.cpp format it is measured against). npumoe's
# rows are what a user gets without flags: `npumoe quantize --bits N` and `npumoe.load(path)`
PAIRS = {"bf16": (None, "F16"), "int4": (4, "Q4_0"), "int2": (2, "Q2_K")}
LLAMA_FTYPES = {"Q4_0": 2, "Q2_K": 10}  # llama_ftype values (llama.h)
GOALS = {"bf16": 1.0, "int4": 1.1, "int2": 1.5}  # npumoe decode tok/s ÷ llama.cpp's, issue 34
PREFILL_GOAL = 1.0  # npumoe prefill tok/s ÷ llama.cpp's, every format
THREADS = 2
# Untimed rounds first: after one, the next round's first prefill still ran slow for both engines (docs/performance.md,
# "bench cpu"): a fresh process's memory settles over the first few seconds.
WARMUP_ROUNDS = 2
LLAMA_MISSING = "llama.cpp rows need llama-cpp-python and gguf: pip install 'npumoe[bench]'"


@dataclass
class Row:
    engine: str
    format: str
    decode_tok_s: float  # medians of the rounds
    prefill_tok_s: float
    weight_mb_per_token: float
    decode_rounds: list[float] = field(default_factory=list)  # tok/s, round by round
    prefill_rounds: list[float] = field(default_factory=list)

    def gb_s(self) -> float:
        return self.decode_tok_s * self.weight_mb_per_token / 1e3


class NpumoeRunner:
    def __init__(self, path: Path):
        import npumoe

        self.model = npumoe.load(path)
        self.engine = npumoe.Engine(self.model, max_context=512)
        self.weight_bytes = npumoe_decode_bytes(self.model)

    def prefill(self, ids) -> int:
        return int(self.engine.generate(ids, max_new_tokens=1)[0])  # the LM head on the last chunk only

    def decode(self, token: int, tokens: int) -> None:
        for _ in range(tokens):
            token = int(self.engine.decode(token).argmax())


class LlamaRunner:
    def __init__(self, path: Path):
        import llama_cpp

        with native_output_silenced(1, 2):
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=THREADS,
                                       n_threads_batch=THREADS, verbose=False)
        self.weight_bytes = gguf_decode_bytes(path)
        self._logits_ith, self._vocab = llama_cpp.llama_get_logits_ith, self.llm.n_vocab()  # read once, not a token

    def prefill(self, ids) -> int:
        self.llm.reset()
        self.llm.eval(ids.tolist())
        return self._next()

    def decode(self, token: int, tokens: int) -> None:
        for _ in range(tokens):
            self.llm.eval([token])
            token = self._next()

    def _next(self) -> int:
        """The greedy token from the last position's logits, read from the context (llama-cpp-python fills
        ``Llama.scores`` only with ``logits_all`` since 0.3.17)."""
        return int(np.ctypeslib.as_array(self._logits_ith(self.llm.ctx, -1), shape=(self._vocab,)).argmax())


def gguf_decode_bytes(path: Path) -> int:
    """The same for a GGUF file, from its tensors' stored sizes (stacked experts scaled by top-k / E)."""
    import gguf

    from npumoe.models.gguf_export import ARCHITECTURES

    reader = gguf.GGUFReader(path)
    arch = ARCHITECTURES[CONFIG["model_type"]]
    used = reader.fields[f"{arch}.expert_used_count"].parts[-1][0]
    experts = reader.fields[f"{arch}.expert_count"].parts[-1][0]
    total = 0.0
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            continue
        total += tensor.n_bytes * (used / experts if "_exps" in tensor.name else 1)
    return int(total)


def prepared(with_llama: bool) -> dict[str, tuple[Path, Path | None]]:
    """npumoe format → (its checkpoint, the llama.cpp GGUF it is paired with), written once."""
    import npumoe
    from npumoe.models.checkpoints.quantize import quantize_checkpoint

    source = write_random_checkpoint(CONFIG, CHECKPOINT)
    paths = {}
    for fmt, (bits, llama_format) in PAIRS.items():
        ckpt = source if bits is None else source.with_name(f"{source.name}-int{bits}")
        if bits is not None and not in_current_format(ckpt):
            quantize_checkpoint(source, ckpt, bits=bits, group=64)
        gguf_path = GGUF_DIR / f"model-{llama_format}.gguf" if with_llama else None
        if gguf_path is not None and not gguf_path.is_file():
            with task(f"writing the {llama_format} GGUF (once)"):
                _write_gguf(npumoe.load(source, dtype="bfloat16"), llama_format)
        paths[fmt] = (ckpt, gguf_path)
    return paths


def in_current_format(ckpt: Path) -> bool:
    """Whether a cached quantised copy is in the format this npumoe writes (an older one still loads, but not as a
    user's fresh `npumoe quantize` output would: version 1 was re-tiled at load)."""
    from npumoe.core.base.outputs import json_object
    from npumoe.models.checkpoints import lut

    section = json_object(ckpt / "config.json").get(lut.SECTION)
    return isinstance(section, dict) and section.get("version") == lut.VERSION


def _write_gguf(model, llama_format: str) -> None:
    from npumoe.models.gguf_export import write_gguf

    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    f16 = GGUF_DIR / "model-F16.gguf"
    if not f16.is_file():
        write_gguf(model, CONFIG["model_type"], f16.with_suffix(".part")).rename(f16)
    if llama_format == "F16":
        return
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPES[llama_format], THREADS
    out = GGUF_DIR / f"model-{llama_format}.gguf"
    part = out.with_suffix(".part")
    with native_output_silenced(1, 2):  # its per-tensor progress lines
        failed = llama_cpp.llama_model_quantize(str(f16).encode(), str(part).encode(), params)
    if failed:
        raise RuntimeError(f"llama.cpp could not quantise {f16} to {llama_format}")
    part.rename(out)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(rounds: int, prefill_tokens: int, decode_tokens: int) -> tuple[list[Row], float, str | None]:
    """Both engines' rows (medians of the rounds), and the machine's read bandwidth in GB/s: the best of a probe
    run in every round, between the engines, since a shared machine's bandwidth moves during a run (one probe
    after the rounds could read less than decode had streamed: docs/performance.md, "bench cpu")."""
    with_llama = all(importlib.util.find_spec(m) for m in ("llama_cpp", "gguf"))
    paths = prepared(with_llama)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, CONFIG["vocab_size"], prefill_tokens)
    short = prompt[:16]  # decode starts after a 16-token prompt
    runners = {}
    with task("loading both engines"):
        for fmt, (ckpt, gguf_path) in paths.items():
            runners[("npumoe", fmt)] = NpumoeRunner(ckpt)
            if gguf_path is not None:
                runners[("llama.cpp", PAIRS[fmt][1])] = LlamaRunner(gguf_path)
        read_bandwidth = mapped_reader(CHECKPOINT)
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {key: ([], []) for key in runners}
    bandwidth = 0.0
    with task("timing", (WARMUP_ROUNDS + rounds) * len(runners), "runs") as step:
        for r in range(1 - WARMUP_ROUNDS, rounds + 1):  # rounds up to 0 warm up, untimed
            for key, runner in runners.items():  # npumoe and llama.cpp alternate, format by format
                step.describe(f"round {r}/{rounds}: {key[0]} {key[1]}" if r > 0 else f"warming up {key[0]} {key[1]}")
                prefill = timed(lambda: runner.prefill(prompt))
                token = runner.prefill(short)
                decode = timed(lambda: runner.decode(token, decode_tokens))
                step.advance()
                if r > 0:
                    times[key][0].append(decode_tokens / decode)
                    times[key][1].append(prefill_tokens / prefill)
            bandwidth = max(bandwidth, read_bandwidth() / 1e9)
    rows = [Row(engine, fmt, statistics.median(dec), statistics.median(pre), runners[(engine, fmt)].weight_bytes / 1e6,
                dec, pre) for (engine, fmt), (dec, pre) in times.items()]
    return rows, bandwidth, None if with_llama else LLAMA_MISSING


def verdict(ratio: float, ours: list[float], theirs: list[float], goal: float) -> str:
    """The ratio of medians against its goal, with the spread of the rounds' own ratios (each round runs both
    engines back to back, so its ratio shares the machine's state of the moment), and more decimals where two
    would hide which side of the goal it falls on."""
    digits = 2
    while round(ratio, digits) == goal != ratio and digits < 6:
        digits += 1
    spread = [a / b for a, b in zip(ours, theirs)]
    rounds = f"rounds {min(spread):.{digits}f}-{max(spread):.{digits}f}; " if len(spread) > 1 else ""
    return f"{ratio:.{digits}f}× ({rounds}goal ≥ {goal}×, {'met' if ratio >= goal else 'not met'})"


def render(rows: list[Row], bandwidth: float, note: str | None, console: Console) -> None:
    table = Table(title=f"CPU decode and prefill, Qwen3-30B-A3B widths (2 layers, vocab 8192), {THREADS} threads, "
                        "medians of interleaved rounds")
    for col in ("engine", "format", "decode tok/s", "prefill tok/s", "weight MB/token", "decode GB/s", "of read BW"):
        table.add_column(col, justify="left" if col in ("engine", "format") else "right")
    for row in rows:
        table.add_row(row.engine, row.format, f"{row.decode_tok_s:.1f}", f"{row.prefill_tok_s:.1f}",
                      f"{row.weight_mb_per_token:.0f}", f"{row.gb_s():.1f}", f"{row.gb_s() / bandwidth:.2f}")
    console.print(table)
    by_key = {(r.engine, r.format): r for r in rows}
    for fmt, (_, llama_format) in PAIRS.items():
        ours, theirs = by_key.get(("npumoe", fmt)), by_key.get(("llama.cpp", llama_format))
        if ours and theirs:
            decode = verdict(ours.decode_tok_s / theirs.decode_tok_s, ours.decode_rounds, theirs.decode_rounds,
                              GOALS[fmt])
            prefill = verdict(ours.prefill_tok_s / theirs.prefill_tok_s, ours.prefill_rounds, theirs.prefill_rounds,
                               PREFILL_GOAL)
            console.print(f"npumoe {fmt} / llama.cpp {llama_format}: decode {decode}, prefill {prefill}")
    console.print(f"read bandwidth of this machine (mapped weights, the best pass of a probe each round): "
                  f"{bandwidth:.1f} GB/s; weight MB/token: every matrix a decode token reads (top-8 of 128 experts a "
                  "layer; the embedding's one row left out)")
    if note:
        console.print(note)


@click.command("cpu")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1), help="Interleaved rounds (medians).")
@click.option("--prefill", "prefill_tokens", default=256, show_default=True, type=click.IntRange(16, 496),
              help="Prompt tokens timed for prefill.")
@click.option("--decode", "decode_tokens", default=32, show_default=True, type=click.IntRange(1, 480),
              help="Decode steps timed per round.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_cpu_command(rounds, prefill_tokens, decode_tokens, as_json):
    """npumoe's CPU path against llama.cpp on one model: decode and prefill tokens/s per format.

    npumoe bf16 / int4 / int2 (npumoe quantize --bits 4|2 --linears all) against llama.cpp F16 / Q4_0 / Q2_K,
    interleaved in one process. The llama.cpp rows need llama-cpp-python and gguf (pip install
    'npumoe[bench]'); without them it prints npumoe's rows and says so. The model (~2.6 GB, with its
    copies ~6 GB) is written once to the bench cache.

    \b
    Examples:
      npumoe bench cpu
      NPUMOE_LUT_KERNEL=avx2 npumoe bench cpu --json   # the AVX2 kernels on an AVX-512 machine
    """
    rows, bandwidth, note = run(rounds, prefill_tokens, decode_tokens)
    if as_json:
        click.echo(json.dumps({"rows": [asdict(r) | {"decode_gb_s": r.gb_s()} for r in rows],
                               "read_bandwidth_gb_s": bandwidth, "note": note}, indent=1))
    else:
        render(rows, bandwidth, note, Console())
