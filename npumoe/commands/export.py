"""`npumoe export`: the whole model as one ExecuTorch program, with the native runner beside it."""

from __future__ import annotations

import click

from npumoe.commands.options import model_option
from npumoe.core.base.errors import InputError
from npumoe.core.ir.backend import plugins
from npumoe.core.runtime import DEFAULT_CHUNK


@click.command("export")
@model_option
@click.option("--target", required=True, type=click.Choice([n for n, p in plugins().items() if p.program]),
              help="Where the program runs (targets whose backends npumoe can put a whole model on).")
@click.option("--out", required=True, type=click.Path(), help="Directory for model.pte, npumoe-run, the tokenizer "
                                                               "and manifest.json (replaced only when complete).")
@click.option("--plan", "plan_path", default=None, type=click.Path(),
              help="Keep this plan's static expert dispatch (its capacities, overflow spilled exactly); default: every "
                   "routed pair computed on its own.")
@click.option("--chunk", default=None, type=click.IntRange(1),
              help=f"Tokens a prefill call takes [default: the plan's, else {DEFAULT_CHUNK}].")
@click.option("--max-context", default=None, type=click.IntRange(1),
              help="KV cache length [default: min(model max, 512)].")
@click.option("--decode-on", type=click.Choice(["npu", "cpu"]), default=None,
              help="Where the decode method runs: on the target's device (npu) or on the CPU (disaggregated: the "
                   "device prefills). Default: whichever the cost model gives the shorter decode step, as decode is "
                   "bound by the experts' weight bytes and the NPU's launch cost (a small model decodes on the CPU).")
def export_command(model_dir, target, out, plan_path, chunk, max_context, decode_on):
    """Export a model as one ExecuTorch program (prefill and decode over one KV cache) and build npumoe-run, a
    native runner that needs neither Python nor torch.

    \b
    Examples:
      npumoe export --target cpu --out demo-cpu
      npumoe export --target htp --decode-on cpu --out demo-htp
      demo-cpu/npumoe-run demo-cpu/model.pte --prompt "def fib" --max-new-tokens 32
      demo-cpu/npumoe-run demo-cpu/model.pte --tokens 1,2,3 --max-new-tokens 8 --json
    """
    from npumoe.core.planning.plan import Plan
    from npumoe.core.tools.export import export
    from npumoe.models.loader import load

    plan = Plan.load(plan_path) if plan_path else None
    if plan is not None and chunk is not None and chunk != plan.chunk:
        raise InputError(f"--chunk {chunk} differs from the plan's chunk {plan.chunk}, which its capacities were "
                         "fitted to; leave --chunk out.")
    model = load(model_dir, dtype="float32")
    manifest = export(model, target, out, plan=plan, chunk=chunk, max_context=max_context, decode_on=decode_on,
                      report=click.echo)
    sizes = ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in manifest["files"].items())
    click.echo(f"wrote {out} in {manifest['export_seconds']:.0f} s: {sizes}")
    click.echo(f"run it: {out}/npumoe-run {out}/model.pte --tokens 1,2,3 --max-new-tokens 16 --json")
