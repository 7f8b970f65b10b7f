"""`npumoe inspect`: what a checkpoint is, as npumoe understands it."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.ir.spec import ModelSpec, MoESpec
from npumoe.models.demo import DEMO_DIR


def _count(shapes: dict) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def parameter_counts(spec: ModelSpec) -> dict[str, int]:
    """Total and per-token active parameters (embeddings counted once)."""
    from npumoe.core.ir.weights import attention_shapes, expected_shapes, mlp_shapes

    total = _count(expected_shapes(spec))
    active = total
    for i, ls in enumerate(spec.layers):
        if isinstance(ls.ffn, MoESpec):
            per_expert = _count(mlp_shapes("e", ls.ffn.expert, spec.hidden_size))
            active -= per_expert * (ls.ffn.num_experts - ls.ffn.top_k)
    attention = sum(_count(attention_shapes("a", ls.attention, spec.hidden_size)) for ls in spec.layers)
    return {"total": total, "active_per_token": active, "attention": attention}


def describe_router(moe: MoESpec) -> str:
    r = moe.router
    parts = [f"{r.scoring} top-{r.top_k}"]
    if r.n_group > 1:
        parts.append(f"group-limited {r.topk_group}/{r.n_group}")
    if r.correction_bias:
        parts.append("bias-corrected")
    if r.normalize:
        parts.append("renormalised")
    if r.routed_scaling != 1.0:
        parts.append(f"×{r.routed_scaling:g}")
    if moe.shared is not None:
        parts.append("+shared" + (" (gated)" if moe.shared_gate else ""))
    return ", ".join(parts)


def layer_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2, 5"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _human(n: float, unit: str = "") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}".strip()
        n /= 1000
    return f"{n:.3g} P{unit}"


FORMAT_NAMES = {"fp8": "block FP8", "mxfp4": "MXFP4"}
DTYPE_SHORT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}


def packed_line(packed, source: str) -> str:
    """How many matrices run on the LUT kernels (routed experts, and other linears after quantize --linears
    all), in which formats, and why any do not (only MXFP4 offers matrices it may keep widened: those with a
    scale float16 cannot hold)."""
    count, offered = len(packed), len(packed.candidates)
    others = sum(".experts." not in name for name in packed)
    formats = ", ".join(f"{bits}-bit group {group}" for bits, group in packed.formats) or "none"
    share = str(count - others) if count == offered else f"{count - others} of {offered - others}"
    what = f"{share} routed-expert matrices" + (f" and {others} other linears" if others else "")
    line = f"{what} packed for the LUT kernels ({formats}; from {source})"
    kept = offered - count
    return f"{line}; {kept} kept widened because their scales are outside fp16" if kept else line


@click.command("inspect")
@click.argument("model_dir", required=False, default=str(DEMO_DIR), type=click.Path())
@click.option("--check-values", is_flag=True, help="Also read every tensor and name each one holding NaN or Inf "
                                                   "(streams the whole checkpoint: minutes for tens of GB).")
def inspect_command(model_dir: str, check_values: bool):
    """Show a checkpoint's layers, experts, router, parameter counts and sizes.

    MODEL_DIR defaults to the shipped demo model. Example: npumoe inspect ~/models/Qwen3-30B-A3B
    """
    from npumoe.core.ir.weights import mlp_shapes
    from npumoe.models.checkpoints.stored_formats import stored_format
    from npumoe.models.loader import is_gptq, load

    model = load(model_dir)
    spec = model.spec
    console = Console()
    counts = parameter_counts(spec)
    disk = sum(f.stat().st_size for f in model.path.glob("*.safetensors"))
    console.print(f"[bold]{model.path}[/bold]  family [cyan]{spec.family}[/cyan]  fingerprint {spec.fingerprint()}")
    console.print(
        f"vocab {spec.vocab_size}, hidden {spec.hidden_size}, {spec.num_layers} layers "
        f"({len(spec.moe_layers)} MoE), tied embeddings: {spec.tie_embeddings}"
    )
    console.print(
        f"parameters {_human(counts['total'])} total, {_human(counts['active_per_token'])} active per token; "
        f"fp32 {_human(counts['total'] * 4, 'B')}, fp16 {_human(counts['total'] * 2, 'B')}, "
        f"on disk {_human(disk, 'B')}"
    )
    stored = ", ".join(f"{DTYPE_SHORT.get(str(d), str(d))} {_human(n)}" for d, n in model.weights.stored_dtypes.items())
    fmt = stored_format(model.config) if not is_gptq(model.config) else None
    packed = getattr(model.weights, "packed", None)
    widened = f" (as widened from {FORMAT_NAMES[fmt]}, tensor by tensor when used)" if fmt and not packed else ""
    console.print(f"stored as {stored} parameters{widened}; compute dtype {DTYPE_SHORT[str(model.weights.dtype)]} "
                  "(matrices; norms and router in fp32)")
    if packed is not None and packed.candidates:
        console.print(packed_line(packed, "a GPTQ export" if is_gptq(model.config) else
                                  f"{FORMAT_NAMES[fmt]} codes" if fmt else "npumoe quantize"))
    table = Table("layers", "attention", "ffn", "experts", "router", "expert size (fp16)")
    groups: dict[tuple, list[int]] = {}
    for i, ls in enumerate(spec.layers):
        att = ls.attention
        att_desc = f"{att.kind} {att.num_heads}/{att.num_kv_heads}×{att.head_dim}"
        if att.sliding_window:
            att_desc += f", window {att.sliding_window}"
        if att.sinks:
            att_desc += ", sinks"
        if att.qk_norm:
            att_desc += f", qk-norm ({att.qk_norm})"
        if isinstance(ls.ffn, MoESpec):
            size = _count(mlp_shapes("e", ls.ffn.expert, spec.hidden_size)) * 2
            key = (att_desc, f"MoE I={ls.ffn.expert.intermediate}", str(ls.ffn.num_experts),
                   describe_router(ls.ffn), _human(size, "B"))
        else:
            key = (att_desc, f"dense I={ls.ffn.intermediate}", "-", "-", "-")
        groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        table.add_row(layer_ranges(indices), *key)
    console.print(table)
    if check_values:
        report_non_finite(console, model.path)
    else:
        console.print(f"tensor values not read; npumoe inspect --check-values {model.path} reads them all and names "
                      "any tensor holding NaN or Inf")


def report_non_finite(console: Console, path) -> None:
    """Read the checkpoint tensor by tensor (mapped, so memory stays flat) and name every tensor holding NaN
    or Inf with its counts: a non-finite weight otherwise shows only as blank generated text."""
    from npumoe.core.base.progress import task
    from npumoe.models.checkpoints.directory import open_checkpoint

    ckpt = open_checkpoint(path)
    found = []
    with task("checking values", total=ckpt.nbytes / 1e6, unit="MB") as step:
        for key, entry in ckpt.entries.items():
            if entry.dtype.is_floating_point:
                nan, inf = non_finite_counts(ckpt.tensor(key))
                if nan or inf:
                    found.append(f"  {key}: {nan} NaN, {inf} Inf of {entry.numel}")
            step.advance(entry.nbytes / 1e6)
    if found:
        floats = sum(e.dtype.is_floating_point for e in ckpt.entries.values())
        console.print(f"[red]{len(found)} of {floats} floating-point tensors hold NaN or Inf[/red] (stored names):\n"
                      + "\n".join(found))
    else:
        console.print(f"values: every floating-point tensor is finite ({_human(ckpt.nbytes, 'B')} read)")


def non_finite_counts(tensor) -> tuple[int, int]:
    """(NaN, Inf) counts, 16 M elements at a time so a large embedding needs no tensor-sized mask; fp8 kinds
    torch cannot test directly are widened piece by piece."""
    import torch

    from npumoe.core.ir.tensorfile import FLOAT_DTYPES

    nan = inf = 0
    for part in tensor.reshape(-1).split(1 << 24):
        part = part if part.dtype in FLOAT_DTYPES else part.float()
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf
