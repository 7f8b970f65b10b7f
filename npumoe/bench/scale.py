"""`npumoe bench scale`: every command on a checkpoint of a real model's size, time and memory measured.

The checkpoint has a real model's exact config and random bf16 weights, laid out as the Hub
stores it (shards of at most 5 GB with their index, one module per expert). It is written once
to a cache directory. Each command then runs in its own process, as a user would run it, and
is sampled every few milliseconds for its private memory (RssAnon: what it allocated, not the
mapped weights the kernel can drop) and its resident set, with wall time and bytes written.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.base.errors import InputError
from npumoe.core.base.machine import physical_memory
from npumoe.core.base.native import cache_dir
from npumoe.core.base.progress import task

OLMOE_1B_7B_0924 = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "clip_qkv": None,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 50304,
    "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
MODELS = {"olmoe-1b-7b": OLMOE_1B_7B_0924, "qwen3-30b-a3b": QWEN3_30B_A3B}
SHARD_BYTES = 5 << 30  # transformers' default max_shard_size
CACHE = cache_dir("bench-scale")

# canonical name → the name a Hub checkpoint stores it under (Llama-style, one module per expert)
HUB_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
HUB_LAYER = [(re.compile(p), r) for p, r in (
    (r"attn_norm\.weight", "input_layernorm.weight"), (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"attn\.(q|k|v|o)\.weight", r"self_attn.\1_proj.weight"),
    (r"attn\.(q|k)_norm\.weight", r"self_attn.\1_norm.weight"),
    (r"moe\.router\.weight", "mlp.gate.weight"),
    (r"moe\.experts\.(\d+)\.(gate|up|down)\.weight", r"mlp.experts.\1.\2_proj.weight"),
)]  # fmt: skip


def hub_name(canonical: str) -> str:
    if canonical in HUB_TOP:
        return HUB_TOP[canonical]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical).groups()
    for pattern, replacement in HUB_LAYER:
        if pattern.fullmatch(rest):
            return f"model.layers.{layer}.{pattern.sub(replacement, rest)}"
    raise ValueError(f"no Hub name for {canonical}")


def write_random_checkpoint(cfg: dict, out: Path, seed: int = 0, progress: bool | None = None) -> Path:
    """Random bf16 weights for ``cfg``, sharded with an index as the Hub stores them; reuses ``out`` if complete."""
    import torch

    from npumoe.core.ir.tensorfile import INDEX, SafetensorsWriter
    from npumoe.core.ir.weights import expected_shapes
    from npumoe.models.registry import adapter_for

    if (out / "config.json").is_file():
        return out
    spec = adapter_for(cfg["model_type"]).spec(cfg)
    shapes = expected_shapes(spec)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 26, generator=gen) * 0.02).to(torch.bfloat16)  # slices of it, at random offsets

    def tensor(name: str, shape: tuple[int, ...]):
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        n = math.prod(shape)
        if n <= pool.numel():  # a view: no copy
            start = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=gen))
            return pool[start:start + n].view(shape)
        flat = pool.repeat(n // pool.numel() + 1)[:n]
        return flat.view(shape)

    out.mkdir(parents=True, exist_ok=True)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    shards = max(1, math.ceil(total / SHARD_BYTES))
    weight_map, writer, written, index = {}, None, 0, 0
    with task(f"writing a random {cfg['model_type']} checkpoint", total / 1e6, "MB", progress) as step:
        for name, shape in shapes.items():
            nbytes = math.prod(shape) * 2
            if writer is None or written + nbytes > SHARD_BYTES:
                if writer is not None:
                    writer.finish({"format": "pt"})
                index += 1
                writer, written = SafetensorsWriter(out / f"model-{index:05d}-of-{shards:05d}.safetensors",
                                                    tensors=len(shapes)), 0
            writer.add(hub_name(name), tensor(name, shape))
            weight_map[hub_name(name)] = writer.path.name
            written += nbytes
            step.advance(nbytes / 1e6)
        writer.finish({"format": "pt"})
    if index != shards:  # the estimate of the shard count is written into every shard's name
        raise RuntimeError(f"wrote {index} shards, named for {shards}")
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "npumoe_tokenizer.json").write_text(json.dumps({"kind": "bytes"}))  # text → byte ids, for the bench
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def cut(ckpt: Path, layers: int, out: Path) -> Path:
    """The first ``layers`` layers of ``ckpt`` as a checkpoint: the same shards (linked), a shorter config."""
    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((ckpt / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}, indent=2))
    return out


class Sampler(threading.Thread):
    """Peak RssAnon / VmRSS and bytes written of a running process, read from /proc every few ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_anon, self.peak_rss, self.written = pid, 0, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                io = Path(f"/proc/{self.pid}/io").read_text()
            except OSError:
                break
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            kb = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in ("RssAnon", "VmHWM")}
            self.peak_anon = max(self.peak_anon, kb.get("RssAnon", 0))
            self.peak_rss = max(self.peak_rss, kb.get("VmHWM", 0))
            self.written = int(dict(line.split(": ") for line in io.splitlines())["write_bytes"])
            time.sleep(0.005)


def measure(argv: list[str], env: dict | None = None) -> dict:
    """Run ``npumoe *argv`` in a fresh process (with ``env`` as its environment, if given); wall time, peaks,
    bytes written, its stdout and its stderr's last line. While it runs, the bench's own line carries the child's
    latest progress line (its count and time left), which a piped child prints every few seconds."""
    with task(f"npumoe {argv[0]}, measured in its own process") as step:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", "from npumoe.cli import main; main()", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        lines: list[str] = []
        reader = threading.Thread(target=_follow, args=(proc.stderr, lines, step, argv[0]), daemon=True)
        reader.start()
        out = proc.stdout.read()
        proc.wait()
        reader.join()
        wall = time.perf_counter() - start
        sampler.done.set()
        sampler.join()
    err = "\n".join(lines)
    if proc.returncode:
        raise click.ClickException(f"npumoe {' '.join(argv)} failed ({proc.returncode}): {err.strip()[-2000:]}")
    last = [line for line in lines if line.startswith("[")]
    return {"command": " ".join(argv), "seconds": wall, "peak_anon_bytes": sampler.peak_anon,
            "peak_rss_bytes": sampler.peak_rss, "written_bytes": sampler.written, "summary": last[-1] if last else "",
            "stdout": out}


def _follow(stream, lines: list[str], step, command: str) -> None:
    """Every line of a child's stderr into ``lines``; its progress lines (``what: 3/9 units, 00:31 elapsed, ~01:12
    left``) also into the bench's ``step``."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        if " elapsed" in line:
            shown = ", ".join(part for part in line.strip().split(", ") if not part.endswith(" elapsed"))
            step.describe(f"npumoe {command} ({shown}), measured in its own process")


def bf16_decode_bytes(ckpt: Path) -> int:
    """Weight bytes one decode token reads from the checkpoint's bf16 (attention, router, top-k experts, LM head)."""
    from npumoe.core.ir.spec import MoESpec
    from npumoe.core.ir.weights import attention_shapes, mlp_shapes
    from npumoe.models.loader import read_config
    from npumoe.models.registry import adapter_for

    spec = adapter_for(read_config(ckpt)["model_type"]).spec(read_config(ckpt))
    h, params = spec.hidden_size, spec.vocab_size * spec.hidden_size
    for ls in spec.layers:
        params += sum(math.prod(s) for s in attention_shapes("a", ls.attention, h).values())
        if isinstance(ls.ffn, MoESpec):
            params += ls.ffn.num_experts * h
            params += ls.ffn.top_k * sum(math.prod(s) for s in mlp_shapes("e", ls.ffn.expert, h).values())
        else:
            params += sum(math.prod(s) for s in mlp_shapes("m", ls.ffn, h).values())
    return 2 * params


def decode_bound(weight_bytes: int, bandwidth: float) -> dict:
    """The decode rate ``bandwidth`` (bytes/s) allows a token reading ``weight_bytes``."""
    return {"weight_bytes_per_token": weight_bytes, "read_gb_s": bandwidth / 1e9,
            "bound_tok_s": bandwidth / weight_bytes}


def int4_decode_bytes(int4: Path) -> int:
    from npumoe.bench.weight_bytes import npumoe_decode_bytes
    from npumoe.models.loader import load

    return npumoe_decode_bytes(load(int4))


def decode_tok_s(summary: str) -> float | None:
    """The decode rate `npumoe generate` printed on its last line ("... decode 0.01 s/token (100 tok/s)]")."""
    found = re.search(r"decode [^(]*\(([\d.e+]+) tok/s\)", summary)
    return float(found.group(1)) if found else None


def mapped_reader(ckpt: Path, nbytes: int = 1 << 30, passes: int = 3) -> Callable[[], float]:
    """A probe of the bytes/s this machine streams from the checkpoint's own mapped weights (the first GB of its
    tensors, read once to bring them into the page cache): each call gives the best of ``passes`` timed passes
    (the first ones run slower). What decode reads, pages and all. A scratch buffer misleads both ways: partly
    served from a last-level cache the guest does not see, or slowed by fragmented 4 KB pages (docs/performance.md,
    "Read-bandwidth probe")."""
    import torch

    from npumoe.luts.kernels import kernels
    from npumoe.models.loader import load

    weights, arrays, total = load(ckpt, dtype="bfloat16").weights, [], 0
    for name in weights:
        if total >= nbytes:
            break
        stored = weights.source(name).read()
        arrays.append(stored.view(torch.uint8).numpy().reshape(-1))
        total += stored.nbytes
    k = kernels()
    for a in arrays:
        k.stream_read(a)

    def one_pass() -> float:
        start = time.perf_counter()
        for a in arrays:
            k.stream_read(a)
        return total / (time.perf_counter() - start)
    return lambda: max(one_pass() for _ in range(passes))


STEPS = ("inspect", "calibrate", "plan", "generate", "quantize", "generate-int4", "build")
GOALS = {"inspect": "≤ 3 s, ≤ 0.5 GB private", "plan": "≤ 5 s", "calibrate": "≤ 2 GB private beyond the KV cache",
         "generate": "≤ 2 GB private beyond the KV cache", "quantize": "≤ 2 GB private",
         "generate-int4": "decode ≥ 0.85 of its bound", "build": "one layer ≤ 3 GB private"}
INT4_DECODE_GOAL = 0.85  # of the rate the int4 checkpoint's bytes per token allow (issue 34)


def calibration_text(work: Path) -> Path:
    """The first 4 kB of Python's own documentation, as ``work/calibration.txt``."""
    import pydoc_data.topics

    text = work / "calibration.txt"
    text.write_text("".join(pydoc_data.topics.topics.values())[:4096])
    return text


def run_steps(ckpt: Path, work: Path, steps: tuple[str, ...], console: Console) -> list[dict]:
    """Each command as a user runs it, on ``ckpt``; builds lower a one-layer cut of it."""
    text = calibration_text(work)
    ids = ",".join(
        str(b) for b in "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a,".encode()[:64])
    model = ["--model", str(ckpt)]
    # the checkpoint's stored dtype at every cut: --dtype auto computes a small cut in fp32 (it fits), which
    # doubles its private memory and the bytes a token reads, and per-layer figures would not extrapolate
    computing = [*model, "--dtype", "bfloat16"]
    runs = {
        "inspect": ["inspect", str(ckpt)],
        "calibrate": ["calibrate", *computing, "--text", str(text), "--chunk", "256",
                      "--out", str(work / "profile.json")],
        "plan": ["plan", *model, "--profile", str(work / "profile.json"), "--target", "htp",
                 "--out", str(work / "plan.json")],
        "generate": ["generate", *computing, "--ids", ids, "-n", "16", "--chunk", "64"],
        "quantize": ["quantize", *model, "--bits", "4", "--out", str(work / "int4")],
        # what a user runs after `npumoe quantize --bits 4`: the quantised checkpoint with load()'s defaults
        "generate-int4": ["generate", "--model", str(work / "int4"), "--ids", ids, "-n", "16", "--chunk", "64"],
    }
    results = []
    for step in steps:
        if step == "build":
            results += build_one_layer(ckpt, work, console)
            continue
        console.print(f"[dim]npumoe {' '.join(runs[step])[:160]}[/dim]")
        results.append({"step": step, **without_stdout(measure(runs[step]))})
        if results[-1].get("written_bytes"):
            os.sync()  # (untimed) the next step's figures are its own, not the kernel writing this one's output back
    return results


def without_stdout(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "stdout"}


def build_one_layer(ckpt: Path, work: Path, console: Console) -> list[dict]:
    one = cut(ckpt, 1, work / "one-layer")
    model = ["--model", str(one)]
    measure(["calibrate", *model, "--text", str(work / "calibration.txt"), "--chunk", "256",
             "--out", str(work / "profile1.json")])
    results = []
    cold = {**os.environ, "NPUMOE_BUILD_CACHE": str(work / "build-cache")}  # compiled here, not found in yours
    for target in ("htp", "ane"):
        plan = work / f"plan1-{target}.json"
        measure(["plan", *model, "--profile", str(work / "profile1.json"), "--target", target, "--residency", "npu",
                 "--out", str(plan)])
        argv = ["build", *model, "--plan", str(plan), "--target", target, "--out", str(work / f"build-{target}")]
        console.print(f"[dim]npumoe {' '.join(argv)}[/dim]")
        results.append({"step": f"build {target} (1 layer)", **without_stdout(measure(argv, cold))})
    return results


FULL_TARGETS = "htp,ane,intel_npu"  # what --full builds and runs unless --targets names others


@click.command("scale")
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default="olmoe-1b-7b", show_default=True,
              help="Whose exact config the random-weight checkpoint takes.")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="Only the first N layers (e.g. 8 of Qwen3-30B-A3B's 48, which do not fit this machine): written so, "
                   "or cut from --ckpt.")
@click.option("--ckpt", type=click.Path(file_okay=False), default=None,
              help=f"Use this checkpoint instead of the one written once under {CACHE}.")
@click.option("--steps", default=",".join(STEPS), show_default=True, help="Which commands to run, comma-separated.")
@click.option("--full", is_flag=True,
              help="Instead of --steps: calibrate the whole model once, then for each of --targets plan, build it "
                   "whole and generate a 64-token prompt's 8 new tokens through the built artifacts; top-1 agreement "
                   "with the CPU reference. Each build (~ the checkpoint's size on disk) is deleted once measured.")
@click.option("--targets", default=FULL_TARGETS, show_default=True,
              help="With --full: the targets to build and run, comma-separated.")
@click.option("--work", "work_dir", type=click.Path(), default=None,
              help="With --full: keep the profile, plans, build cache and the record of finished steps here (default: "
                   "a temporary directory); started again with the same --work, a killed run skips the steps it "
                   "finished and its build resumes from the cache.")
@click.option("--keep-builds", is_flag=True, help="With --full --work: keep each target's build in the work directory.")
@click.option("--cluster", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS|local]",
              help="Instead of --steps: lower a one-layer cut's build units (or --layers') for intel_npu on 1, 2, ... "
                   "workers of this Ray cluster (alone: a local one of 1-CPU nodes on 127.0.0.1, one per core), each "
                   "from an empty build cache; wall time and speed-up per worker added, bytes checked against a "
                   "local build (pip install 'npumoe[cluster]').")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_scale_command(model_name, layers, ckpt, steps, full, targets, work_dir, keep_builds, cluster, as_json):
    """Every command on a real-size checkpoint: wall time, peak private memory, peak RSS, bytes written.

    \b
    Examples:
      npumoe bench scale                                   # OLMoE-1B-7B-0924's config, 13.8 GB of bf16
      npumoe bench scale --model qwen3-30b-a3b --layers 8  # Qwen3-30B-A3B's widths, 8 of its 48 layers
      npumoe bench scale --full --work runs/full           # the whole model built for each target and run
      npumoe bench scale --cluster ray://HEAD:10001        # one layer's build on 1, 2, ... of its workers
    """
    chosen = tuple(s.strip() for s in steps.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        raise click.BadParameter(f"unknown step {unknown[0]!r}; choose from {', '.join(STEPS)}.", param_hint="--steps")
    if "generate-int4" in chosen and "quantize" not in chosen[:chosen.index("generate-int4")]:
        raise click.BadParameter("generate-int4 runs the checkpoint the quantize step writes: list quantize before "
                                 "it.", param_hint="--steps")
    if full and cluster:
        raise click.BadParameter("--full builds on this machine; give --full or --cluster, not both.",
                                 param_hint="--cluster")
    if full:
        from npumoe.bench.scale_full import check_work, parse_targets

        chosen_targets = parse_targets(targets)
        if work_dir:
            check_work(Path(work_dir))  # before a checkpoint is written
        if keep_builds and not work_dir:
            raise InputError("--keep-builds keeps the builds in the --work directory; give --work DIR too.")
    elif work_dir or keep_builds or targets != FULL_TARGETS:
        raise InputError("--targets, --work and --keep-builds go with --full.")
    console = Console(stderr=as_json)
    cfg = MODELS[model_name]
    if ckpt:  # --layers cuts a given checkpoint (its shards linked, not copied)
        from npumoe.models.loader import read_config

        read_config(Path(ckpt))  # a directory that is no checkpoint is named now, not by the first step's failure
        path = cut(Path(ckpt), layers, CACHE / f"{Path(ckpt).name}-cut-{layers}") if layers else Path(ckpt)
    elif layers:  # ... and writes only that many layers of the named model
        path = write_random_checkpoint({**cfg, "num_hidden_layers": layers}, CACHE / f"{model_name}-{layers}-layers")
    else:
        path = write_random_checkpoint(cfg, CACHE / model_name)
    if full:
        return _full(path, chosen_targets, Path(work_dir) if work_dir else None, keep_builds, console, as_json)
    if cluster:
        return _cluster(path if layers else cut(path, 1, CACHE / f"{path.name}-cut-1"), cluster, console, as_json)
    with tempfile.TemporaryDirectory(prefix="npumoe-bench-scale-", dir=CACHE) as work:
        results = run_steps(path, Path(work), chosen, console)
        # the quantised checkpoint as npumoe.load holds it by default: packed matrices at their packed size
        int4_bytes = int4_decode_bytes(Path(work) / "int4") if "generate-int4" in chosen else None
    result = {"checkpoint": str(path), "machine": _machine(), "steps": results}
    if "generate" in chosen or int4_bytes:
        bandwidth = mapped_reader(path)()  # the source's mapped weights, probed once for both bounds
    if "generate" in chosen:
        result["decode_bound"] = decode_bound(bf16_decode_bytes(path), bandwidth)
    if int4_bytes:
        measured = decode_tok_s(next(r["summary"] for r in results if r["step"] == "generate-int4"))
        int4_bound = decode_bound(int4_bytes, bandwidth)
        share = measured / int4_bound["bound_tok_s"] if measured else None
        result["decode_bound_int4"] = int4_bound | {"decode_tok_s": measured, "of_bound": share}
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    table = Table("command", "wall s", "peak private GB", "peak RSS GB", "written GB", "goal",
                  title=f"npumoe bench scale: {path.name}, random bf16 weights")
    for r in results:
        table.add_row(r["step"], f"{r['seconds']:.1f}", f"{r['peak_anon_bytes'] / 1e9:.2f}",
                      f"{r['peak_rss_bytes'] / 1e9:.2f}", f"{r['written_bytes'] / 1e9:.2f}",
                      GOALS.get(r["step"].split()[0], ""))
    console.print(table)
    for r in results:
        if r["summary"]:
            console.print(f"{r['step']}: {r['summary']}")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for r in results:
        if r["step"].startswith("build"):
            console.print(f"{r['step']}: the whole {layers}-layer model ≈ {layers * r['seconds'] / 60:.0f} min and "
                          f"{layers * r['written_bytes'] / 1e9:.1f} GB written "
                          "(extrapolated from one layer, not measured)")
    if "decode_bound" in result:
        b = result["decode_bound"]
        console.print(f"decode reads {b['weight_bytes_per_token'] / 1e9:.2f} GB of bf16 weights per token; at this "
                      f"machine's {b['read_gb_s']:.1f} GB/s read that allows {b['bound_tok_s']:.2f} tok/s "
                      f"(goal: ≥ 2/3 of it, {2 * b['bound_tok_s'] / 3:.2f} tok/s)")
    if "decode_bound_int4" in result:
        b = result["decode_bound_int4"]
        rate = (f"decoded {b['decode_tok_s']:.2f} tok/s: {b['of_bound']:.2f} of it (goal ≥ {INT4_DECODE_GOAL})"
                if b["decode_tok_s"] else "generate printed no decode rate")
        console.print(f"int4 (npumoe quantize --bits 4, load() defaults) reads "
                      f"{b['weight_bytes_per_token'] / 1e9:.2f} GB a token; {b['read_gb_s']:.1f} GB/s allows "
                      f"{b['bound_tok_s']:.2f} tok/s; {rate}")
    console.print("peak private = RssAnon (what the process allocated; mapped weights are file pages and not "
                  "counted); RSS counts both. Private memory is sampled every 5 ms.")


def _full(path: Path, targets: tuple[str, ...], work: Path | None, keep_builds: bool, console: Console,
          as_json: bool) -> None:
    from npumoe.bench.scale_full import print_full, run_full

    result = {"checkpoint": str(path), "machine": _machine()}
    if work is None:
        with tempfile.TemporaryDirectory(prefix="npumoe-bench-scale-full-", dir=CACHE) as temporary:
            result["full"] = run_full(path, Path(temporary), targets, console, measure, calibration_text)
    else:
        result["full"] = run_full(path, work, targets, console, measure, calibration_text, keep_builds)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        print_full(result, console)


def _cluster(path: Path, address: str, console: Console, as_json: bool) -> None:
    from npumoe.bench.scale_cluster import print_cluster, run_cluster

    with tempfile.TemporaryDirectory(prefix="npumoe-bench-scale-cluster-", dir=CACHE) as work:
        result = {"checkpoint": str(path), "machine": _machine(),
                  "cluster": run_cluster(path, address, Path(work), calibration_text(Path(work)))}
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        print_cluster(result, console)


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "ram_bytes": physical_memory()}
