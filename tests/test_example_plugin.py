"""A plugin installed from outside npumoe (tests/example_plugin: a module and a dist-info whose entry point
registers it) reaches every command, and the planner keeps it to what it claims."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).parent / "example_plugin"


def npumoe(*argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "npumoe.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("plugin")


def test_an_entry_point_plugin_appears_in_every_command(work):
    for command in ("plan", "build", "generate", "conformance"):
        help_text = "".join(npumoe(command, "--help", cwd=work).stdout.split())  # wrapped anywhere, even at hyphens
        assert "|toy]" in help_text and "toy:anout-of-treeexamplebackend" in help_text, command


def test_it_is_planned_within_its_claims_built_validated_and_run(work):
    text = work / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    done = npumoe("build", "--targets", "toy", "--text", str(text), "--chunk", "16", "--max-context", "128",
                  "--residency", "npu", "--out", str(work / "out"), cwd=work)
    assert done.returncode == 0, done.stderr
    entry = json.loads((work / "out" / "manifest.json").read_text())["targets"]["toy"]
    assert entry["cpu_graphs"] and all(r == "toy does not take the op sdpa" for r in entry["cpu_graphs"].values())
    assert entry["validation"]["cosine"] > 0.9999 and entry["validation"]["greedy_match"] == 16
    ran = npumoe("generate", "--artifacts", str(work / "out"), "--target", "toy", "-n", "4", cwd=work)
    assert ran.returncode == 0 and "4 new tokens" in ran.stderr, ran.stderr
    compared = npumoe("compare", str(work / "out"), "--json", cwd=work)
    assert compared.returncode == 0, compared.stderr
    estimated = json.loads(compared.stdout)["targets"]["toy"]["estimated"]["Toy Chip 1"]  # from its own record
    assert estimated["decode_tok_s"] > 0 and estimated["prefill_tok_s"] > 0
    checked = npumoe("conformance", "--target", "toy", "--json", cwd=work)
    assert checked.returncode == 0 and not json.loads(checked.stdout)["failed"], checked.stdout
