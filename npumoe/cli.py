"""The `npumoe` command line.

Subcommands live in :mod:`npumoe.commands` (benchmarks in :mod:`npumoe.bench`), one module each, and are
imported only when invoked, so `npumoe --help` stays fast. A subcommand is registered here by its dotted path;
an installed backend adds its own (``BackendPlugin.commands``: the HTP's ``hub``, the ANE's ``lint``).
Any :class:`npumoe.core.base.errors.NpumoeError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

import click

from npumoe.core.base.errors import NpumoeError


class LazyGroup(click.Group):
    """A click group whose commands are ``"module:attribute"`` paths, imported on use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


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
            return plugin_object(*added[name])
        return super().get_command(ctx, name)


COMMANDS = {
    "inspect": "npumoe.commands.inspect:inspect_command",
    "generate": "npumoe.commands.generate:generate_command",
    "demo": "npumoe.commands.generate:demo_command",
    "calibrate": "npumoe.commands.plan:calibrate_command",
    "plan": "npumoe.commands.plan:plan_command",
    "build": "npumoe.commands.build:build_command",
    "compare": "npumoe.commands.compare:compare_command",
    "conformance": "npumoe.commands.conformance:conformance_command",
    "quantize": "npumoe.commands.quantize:quantize_command",
    "export": "npumoe.commands.export:export_command",
    "bench": "npumoe.cli:bench",
}

BENCHMARKS = {
    "runtime": "npumoe.bench.runtime:bench_runtime_command",
    "lut": "npumoe.bench.lut:bench_lut_command",
    "hvx": "npumoe.bench.hvx:bench_hvx_command",
    "neon": "npumoe.bench.neon:bench_neon_command",
    "scale": "npumoe.bench.scale:bench_scale_command",
    "decode": "npumoe.bench.decode:bench_decode_command",
    "cpu": "npumoe.bench.cpu:bench_cpu_command",
    "prefetch": "npumoe.bench.prefetch:bench_prefetch_command",
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


if __name__ == "__main__":
    main()
