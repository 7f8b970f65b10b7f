"""Options several commands share, so each reads and helps the same everywhere.

Command modules import only this, click and light modules at the top (heavy ones inside the command), so that
`npumoe X --help` renders without torch."""

from __future__ import annotations

import click

from npumoe.core.base.errors import InputError
from npumoe.core.ir import DTYPE_POLICIES
from npumoe.core.ir.backend import BuildOption, plugin, plugins
from npumoe.models.demo import DEMO_DIR


def model_option(f):
    return click.option(
        "--model", "model_dir", default=str(DEMO_DIR), show_default="the shipped demo model", type=click.Path(),
        help="Hugging Face checkpoint directory (config.json + *.safetensors).",
    )(f)


class CpuDtype(click.Choice):
    """The compute dtypes the CPU path has kernels for; ``float16`` (a policy of the Python API) is refused with the
    reason, since torch computes it on a CPU many times slower than fp32."""

    def __init__(self):
        super().__init__([p for p in DTYPE_POLICIES if p != "float16"])

    def convert(self, value, param, ctx):
        if value == "float16":
            raise InputError("--dtype float16 has no CPU kernels (torch runs it many times slower than float32); use "
                             "--dtype bfloat16 for 2 bytes a weight on the bf16 kernels, or auto.")
        return super().convert(value, param, ctx)


def dtype_option(f):
    return click.option(
        "--dtype", default="auto", show_default=True, type=CpuDtype(),
        help="Compute dtype of the weight matrices: auto = the stored bf16 where this CPU's kernels compute from "
             "it faster than from fp32, else float32 when an fp32 copy fits comfortably in free memory, else the "
             "stored dtype (norms, router and attention scores stay fp32).",
    )(f)


def target_option(default: str | None, help: str, npu_only: bool = False, required: bool = True):
    """``--target``, its choices the installed backends (an entry-point plugin appears with no edit here)."""
    names = [name for name in plugins() if not (npu_only and name == "cpu")]
    lines = "; ".join(f"{name}: {plugins()[name].summary}" for name in names)
    return click.option("--target", type=click.Choice(names), default=default, required=required and default is None,
                        show_default=default is not None, help=f"{help} Installed: {lines}.")


def build_options(f):
    """Every installed backend's declared build options, each ``--NAME``; help says which target takes what."""
    declared: dict[str, list[tuple[str, BuildOption]]] = {}
    for name, record in plugins().items():
        for option in record.options:
            declared.setdefault(option.name, []).append((name, option))
    for name, owners in reversed(declared.items()):
        text = "; ".join(f"{target}: {option.help}" for target, option in owners)
        f = click.option(owners[0][1].flag_name, name, is_flag=owners[0][1].flag, default=None, help=text + ".")(f)
    return f


def chosen_build_options(target: str, values: dict) -> dict:
    """The build options given on the command line, refused when ``target`` does not declare them."""
    given = {name: value for name, value in values.items() if value not in (None, False)}
    declared = {option.name: option for option in plugin(target).options}
    for name in given:
        if name not in declared:
            accepted = ", ".join(o.flag_name for o in declared.values()) or "none"
            raise InputError(f"--{name.replace('_', '-')} does not apply to target {target}; its build options "
                             f"are: {accepted}.")
    return given


def options_per_target(targets: list[str], values: dict) -> dict[str, dict]:
    """With several targets, each build option goes to the targets that declare it; one no target declares
    is refused."""
    given = {name: value for name, value in values.items() if value not in (None, False)}
    per_target = {t: {n: v for n, v in given.items() if n in {o.name for o in plugin(t).options}} for t in targets}
    unused = sorted(set(given) - {n for chosen in per_target.values() for n in chosen})
    if unused:
        raise InputError(f"--{unused[0].replace('_', '-')} applies to none of {', '.join(targets)}.")
    return per_target
