"""`npumoe bench dtype`: what ``npumoe.load``'s default compute dtype costs in accuracy against fp32.

``dtype="auto"`` computes from the stored bf16 wherever this CPU has bf16 kernels faster than fp32 (norm
statistics, router scores, softmax and attention logits stay fp32). This sets its logits beside an fp32 load of the
same checkpoint, on the demo model as shipped (fp32: auto rounds nothing), the demo stored in bf16 (a trained model
as Hugging Face checkpoints come), and a one-layer cut of OLMoE-1B-7B's exact config with random bf16 weights (both
written once to the bench cache), for one prompt (held-out text for the demo, random ids for the cut): the largest
logit difference against the largest logit, the cosine per position, and top-1 agreement.
"""

from __future__ import annotations

import json

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from npumoe.bench.scale import CACHE, OLMOE_1B_7B_0924, write_random_checkpoint
from npumoe.core.base.progress import task

PROMPT_TOKENS = 128


def compare(path, name: str, text: str | None) -> dict:
    """Logits of one prompt (``text``, else random ids) under ``dtype="auto"`` and ``"float32"``, and how far apart
    they are."""
    import npumoe

    logits, dtypes = {}, {}
    for dtype in ("auto", "float32"):
        model = npumoe.load(path, dtype=dtype)
        dtypes[dtype] = str(model.weights.dtype).removeprefix("torch.")
        ids = (np.asarray(model.tokenizer.encode(text))[:PROMPT_TOKENS] if text is not None else
               np.random.default_rng(0).integers(3, model.spec.vocab_size, PROMPT_TOKENS))
        logits[dtype] = npumoe.Engine(model).forward(ids).astype(np.float64)
    ours, reference = logits["auto"], logits["float32"]
    cosine = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
    return {"model": name, "auto_dtype": dtypes["auto"],
            "max_abs_diff_over_max_logit": float(np.abs(ours - reference).max() / np.abs(reference).max()),
            "min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean()),
            "top1_agreement": float((ours.argmax(-1) == reference.argmax(-1)).mean())}


@click.command("dtype")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_dtype_command(as_json):
    """The default compute dtype's logits against fp32 (demo model; OLMoE-1B-7B's widths, one layer).

    \b
    Examples:
      npumoe bench dtype
      NPUMOE_LUT_KERNEL=avx2 npumoe bench dtype   # what an AVX2 CPU's default computes
    """
    from npumoe.models.demo import DEMO_DIR
    from npumoe.models.demo.corpus import heldout_texts

    with task("writing the demo in bf16 and OLMoE-1B-7B's one-layer cut (once)"):
        demo_bf16 = _bf16_copy(DEMO_DIR, CACHE / "demo-bf16")
        cut = write_random_checkpoint({**OLMOE_1B_7B_0924, "num_hidden_layers": 1}, CACHE / "olmoe-1b-7b-1-layers")
    text = "".join(heldout_texts(4))
    models = ((DEMO_DIR, "demo", text), (demo_bf16, "demo, stored bf16", text), (cut, "olmoe-1b-7b, 1 layer", None))
    with task("logits under dtype auto and float32", len(models), "models") as step:
        rows = []
        for path, name, prompt in models:
            rows.append(compare(path, name, prompt))
            step.advance()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    table = Table("model", "auto computes in", "max |Δ| / max |logit|", "min cosine", "mean cosine", "top-1",
                  title=f"dtype auto against float32: one {PROMPT_TOKENS}-token prompt's logits")
    for r in rows:
        table.add_row(r["model"], r["auto_dtype"], f"{r['max_abs_diff_over_max_logit']:.2e}", f"{r['min_cosine']:.6f}",
                      f"{r['mean_cosine']:.6f}", f"{r['top1_agreement']:.1%}")
    Console().print(table)


def _bf16_copy(source, out):
    """``source`` with its floating-point tensors rounded to bf16 (how a trained model's Hub checkpoint stores
    them), written once."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from npumoe.core.base.outputs import staged_directory

    if (out / "config.json").is_file():
        return out
    with staged_directory(out) as staging:
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.py", "__pycache__"),
                        dirs_exist_ok=True)
        tensors = load_file(source / "model.safetensors")
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
                  staging / "model.safetensors")
        config = json.loads((staging / "config.json").read_text())
        (staging / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    return out
