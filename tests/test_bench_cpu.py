"""`npumoe bench cpu`'s verdicts: each format's decode and prefill ratio against llama.cpp, judged by its goal."""

from rich.console import Console

from npumoe.commands.bench_cpu import GOALS, PREFILL_GOAL, Row, render


def test_each_ratio_is_judged_against_its_goal():
    rows = [Row("npumoe", "int4", 110.0, 70.0, 76.0), Row("llama.cpp", "Q4_0", 100.0, 100.0, 79.0),
            Row("npumoe", "int2", 90.0, 90.0, 48.0), Row("llama.cpp", "Q2_K", 100.0, 100.0, 57.0)]
    console = Console(record=True, width=200)
    render(rows, bandwidth=50.0, note=None, console=console)
    lines = {line.split(":")[0]: line for line in console.export_text().splitlines() if " / llama.cpp " in line}
    assert lines["npumoe int4 / llama.cpp Q4_0"].endswith(
        f"decode 1.10× (goal ≥ {GOALS['int4']}×, met), prefill 0.70× (goal ≥ {PREFILL_GOAL}×, not met)")
    assert lines["npumoe int2 / llama.cpp Q2_K"].endswith(
        f"decode 0.90× (goal ≥ {GOALS['int2']}×, not met), prefill 0.90× (goal ≥ {PREFILL_GOAL}×, met)")
    assert not any("bf16" in key for key in lines)  # a format without both engines' rows gets no verdict
