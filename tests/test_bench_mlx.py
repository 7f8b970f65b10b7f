"""`npumoe bench mlx`'s verdict: npumoe's mlx decode over mlx-lm's, judged by its goal, with the rounds' spread."""

import pytest
from rich.console import Console

pytest.importorskip("mlx.core", reason="bench mlx needs MLX (pip install 'npumoe[mlx]')", exc_type=ImportError)

from npumoe.bench.mlx import GOAL, Row, render  # noqa: E402


def test_the_decode_ratio_is_judged_against_its_goal():
    rows = [Row("npumoe mlx", 45.0, 120.0, [40.0, 45.0, 50.0], [110.0, 120.0, 130.0]),
            Row("mlx-lm", 50.0, 100.0, [50.0, 50.0, 50.0], [100.0, 100.0, 100.0])]
    console = Console(record=True, width=200)
    render(rows, console)
    line = next(line for line in console.export_text().splitlines() if line.startswith("npumoe mlx / mlx-lm"))
    assert line == f"npumoe mlx / mlx-lm: decode 0.90× (rounds 0.80-1.00; goal ≥ {GOAL}×, not met), prefill 1.20×"


def test_it_is_a_bench_subcommand(capsys):
    from npumoe.cli import main

    main(["bench", "--help"])
    assert "mlx" in capsys.readouterr().out
