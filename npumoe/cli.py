"""The `npumoe` command line.

Subcommands live in :mod:`npumoe.commands` (benchmarks in :mod:`npumoe.bench`), one module each, and are
imported only when invoked, so `npumoe --help` stays fast: a subcommand is registered here by its dotted path and
the line `npumoe --help` lists it with; an installed backend adds its own (``BackendPlugin.commands`` and
``command_help``: the HTP's ``hub``, the ANE's ``lint``). A command module imports nothing heavy at the top, so its
own ``--help`` is fast too.
Any :class:`npumoe.core.base.errors.NpumoeError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from npumoe.core.base.errors import NpumoeError
from npumoe.core.base.outputs import DISK_FULL, disk_full
from npumoe.core.base.progress import shown_by_default


class LazyGroup(click.Group):
    """A click group whose commands are ``"module:attribute"`` paths, imported on use, each listed in the group's
    help with the short help given beside its path (so listing them imports none)."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            path, short_help = self.lazy[name]
            return with_short_help(imported(path), short_help)
        return super().get_command(ctx, name)

    def short_helps(self, ctx) -> dict[str, str]:
        """Command name → its one line in the group's help."""
        return {name: short for name, (_, short) in self.lazy.items()}

    def format_commands(self, ctx, formatter):
        listed = self.short_helps(ctx)
        rows = [(name, listed[name]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class MainGroup(LazyGroup):
    """npumoe's own commands, then those the installed backends bring."""

    def list_commands(self, ctx):
        from npumoe.core.ir.backend import plugin_commands

        return sorted(set(super().list_commands(ctx)) | set(plugin_commands()))

    def get_command(self, ctx, name):
        if name in self.lazy:
            return super().get_command(ctx, name)
        from npumoe.core.ir.backend import plugin_commands, plugin_object

        if name in (added := plugin_commands()):
            record, path = added[name]
            return with_short_help(plugin_object(record, path), record.command_help.get(name))
        return super().get_command(ctx, name)

    def short_helps(self, ctx) -> dict[str, str]:
        """A plugin's command without a line in its ``command_help`` is imported for its own."""
        from npumoe.core.ir.backend import plugin_commands

        added = {name: record.command_help.get(name) for name, (record, _) in plugin_commands().items()}
        return {**{name: short or self.get_command(ctx, name).get_short_help_str() for name, short in added.items()},
                **super().short_helps(ctx)}


def imported(path: str):
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def with_short_help(command: click.Command, short_help: str | None) -> click.Command:
    """``command`` showing ``short_help`` in listings (the same line whether or not it was imported)."""
    if short_help:
        command.short_help = short_help
    return command


# name → ("module:attribute", the short help `npumoe --help` lists it with)
COMMANDS = {
    "inspect": ("npumoe.commands.inspect:inspect_command", "Show a checkpoint's layers, experts and sizes."),
    "generate": ("npumoe.commands.generate:generate_command", "Greedy-generate a continuation."),
    "demo": ("npumoe.commands.generate:demo_command", "The whole job on the embedded demo model."),
    "calibrate": ("npumoe.commands.plan:calibrate_command", "Measure how the experts are really used."),
    "plan": ("npumoe.commands.plan:plan_command", "Plan static shapes for a target."),
    "build": ("npumoe.commands.build:build_command", "Compile a model's NPU graphs for one or more targets."),
    "compare": ("npumoe.commands.compare:compare_command", "Compare built targets: accuracy, costs, tokens/s."),
    "conformance": ("npumoe.commands.conformance:conformance_command",
                    "Check a backend against the reference interpreter."),
    "quantize": ("npumoe.commands.quantize:quantize_command", "Quantise weights to the npumoe LUT format."),
    "export": ("npumoe.commands.export:export_command", "The whole model as one ExecuTorch program."),
    "bench": ("npumoe.cli:bench", "Benchmarks (speed figures live here)."),
}

BENCHMARKS = {
    "runtime": ("npumoe.bench.runtime:bench_runtime_command", "Host-runtime cost and planner padding figures."),
    "lut": ("npumoe.bench.lut:bench_lut_command", "LUT kernels against streaming bandwidth and fp32."),
    "hvx": ("npumoe.bench.hvx:bench_hvx_command", "The HVX LUT-GEMV's instruction counts and modelled cost."),
    "neon": ("npumoe.bench.neon:bench_neon_command", "Estimated NEON LUT kernels on Arm cores."),
    "scale": ("npumoe.bench.scale:bench_scale_command", "Every command on a real-size checkpoint."),
    "decode": ("npumoe.bench.decode:bench_decode_command", "Decode tokens/s and host time per layer."),
    "cpu": ("npumoe.bench.cpu:bench_cpu_command", "npumoe's CPU path against llama.cpp."),
    "prefetch": ("npumoe.bench.prefetch:bench_prefetch_command", "Decode routing predictor: recall and time saved."),
    "mlx": ("npumoe.bench.mlx:bench_mlx_command", "npumoe's mlx target against mlx-lm."),
    "dtype": ("npumoe.bench.dtype:bench_dtype_command", "The default compute dtype's logits against fp32."),
    "export": ("npumoe.bench.export:bench_export_command", "npumoe-run against the Python engine on one program."),
}


@click.group(cls=MainGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="npumoe")
def cli():
    """npumoe: Mixture-of-Experts LLMs on phone and laptop NPUs.

    One Hugging Face MoE checkpoint in; static, NPU-friendly graphs out for the Apple
    Neural Engine (Core ML) and the Qualcomm Hexagon NPU (QNN); one shared host runtime
    for routing, dispatch and combine. Every `--model` defaults to the embedded demo model.
    """


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench():
    """Benchmarks: speed figures live here, never in unit tests."""


def one_line(message: str) -> str:
    """``message`` with line breaks escaped: a path a user gave may hold one, and the error stays one line."""
    return "".join(repr(c)[1:-1] if c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029" else c for c in message)


def main(argv: list[str] | None = None) -> None:
    try:
        with shown_by_default():  # long steps report on stderr (library calls stay quiet unless asked)
            cli.main(args=argv, prog_name="npumoe", standalone_mode=False)
    except NpumoeError as err:
        click.echo(f"error: {one_line(str(err))}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(2 if err.exit_code == 2 else err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except OSError as err:  # a full disk under a write that is not an output's (a cache, a native build)
        if err.errno not in DISK_FULL:
            raise
        click.echo(f"error: {one_line(str(disk_full(err, Path(err.filename or '.'))))}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
