"""`npumoe bench cpu`'s verdicts: each format's decode and prefill ratio against llama.cpp, judged by its goal."""

from rich.console import Console

from npumoe.bench.cpu import GOALS, PREFILL_GOAL, Row, render


def test_each_ratio_is_judged_against_its_goal():
    rows = [Row("npumoe", "int4", 110.0, 70.0, 76.0), Row("llama.cpp", "Q4_0", 100.0, 100.0, 79.0),
            Row("npumoe", "int2", 90.0, 100.0, 48.0), Row("llama.cpp", "Q2_K", 100.0, 100.0, 57.0)]
    console = Console(record=True, width=200)
    render(rows, bandwidth=50.0, note=None, console=console)
    lines = {line.split(":")[0]: line for line in console.export_text().splitlines() if " / llama.cpp " in line}
    assert lines["npumoe int4 / llama.cpp Q4_0"].endswith(
        f"decode 1.10× (goal ≥ {GOALS['int4']}×, met), prefill 0.70× (goal ≥ {PREFILL_GOAL}×, not met)")
    assert lines["npumoe int2 / llama.cpp Q2_K"].endswith(
        f"decode 0.90× (goal ≥ {GOALS['int2']}×, not met), prefill 1.00× (goal ≥ {PREFILL_GOAL}×, met)")
    assert not any("bf16" in key for key in lines)  # a format without both engines' rows gets no verdict


def test_a_verdict_shows_the_rounds_spread_and_the_decimal_that_decides_it():
    """Rounds run both engines back to back, so each round's own ratio is shown as a range; a ratio a hair under
    its goal gets the decimals that show why it is not met."""
    rows = [Row("npumoe", "bf16", 100.0, 99.96, 261.0, [96.0, 100.0, 104.0], [100.0, 99.96, 90.0]),
            Row("llama.cpp", "F16", 100.0, 100.0, 261.0, [100.0, 100.0, 100.0], [90.0, 100.0, 100.0])]
    console = Console(record=True, width=200)
    render(rows, bandwidth=50.0, note=None, console=console)
    line = next(line for line in console.export_text().splitlines() if line.startswith("npumoe bf16 / llama.cpp"))
    assert line.endswith(f"decode 1.00× (rounds 0.96-1.04; goal ≥ {GOALS['bf16']}×, met), "
                         f"prefill 0.9996× (rounds 0.9000-1.1111; goal ≥ {PREFILL_GOAL}×, not met)")
