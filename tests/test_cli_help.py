"""`npumoe --help` and every command's own --help render without importing torch or a toolchain: the command list
comes from the short help registered beside each lazy command, and command modules import heavy things only when
they run."""

import json
import subprocess
import sys

import click

from npumoe.cli import BENCHMARKS, COMMANDS, main
from npumoe.core.ir.backend import BackendPlugin, plugin_commands, plugins

HEAVY = ("torch", "onnx", "onnxruntime", "coremltools", "openvino", "executorch")

# every --help in one fresh interpreter, noting after each which heavy modules are loaded by then
SCRIPT = """
import contextlib, io, json, sys
from npumoe.cli import main
seen = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as done:
            code = done.code
    heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
    seen.append({"argv": argv, "code": code, "usage": "Usage:" in out.getvalue(), "heavy": heavy})
print(json.dumps(seen))
"""


def every_help() -> list[list[str]]:
    return [["--help"], *([name, "--help"] for name in [*COMMANDS, *plugin_commands()]),
            *(["bench", name, "--help"] for name in BENCHMARKS)]


def test_every_help_renders_without_torch_or_a_toolchain():
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(every_help()), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert len(seen) == len(every_help())
    for run in seen:
        assert run["code"] == 0 and run["usage"], run
        assert run["heavy"] == [], f"npumoe {' '.join(run['argv'])} imported {run['heavy']}"


def test_the_command_list_shows_each_registered_line(capsys):
    main(["--help"])
    listed = capsys.readouterr().out
    for name, (_, short_help) in COMMANDS.items():
        assert any(line.split() == [name, *short_help.split()] for line in listed.splitlines()), name
    for name, (record, _) in plugin_commands().items():
        assert record.command_help[name] in listed


@click.command("toyhelp")
def toy_command():
    """A plugin command whose plugin registers no line for it: listed with its own."""


def test_a_plugin_command_without_a_registered_line_is_listed_with_its_own(monkeypatch, capsys):
    record = BackendPlugin(name="toyhelp", caps=plugins()["cpu"].caps, factory="none:none", summary="a test plugin",
                           commands={"toyhelp": "test_cli_help:toy_command"})
    monkeypatch.setattr("npumoe.core.ir.backend.plugin_commands",
                        lambda: {**plugin_commands(), "toyhelp": (record, "test_cli_help:toy_command")})
    main(["--help"])
    assert any(line.split()[:2] == ["toyhelp", "A"] for line in capsys.readouterr().out.splitlines())
