"""`bench scale` runs each command in its own process: the child's progress lines reach the bench's own line, so a
long build shows its count and time left, not only the time spent."""

import io

from npumoe.bench.scale import _follow
from npumoe.core.base.progress import Task


def test_a_childs_progress_line_carries_into_the_benchs_line():
    child = Task("lowering", 252, "graphs")
    child.done = 12
    stream = io.StringIO(f"loading plan\n{child.line()}\n[htp] built 252 graphs\n")
    lines, bench = [], Task("npumoe build, measured in its own process", None, "")
    _follow(stream, lines, bench, "build")
    assert lines == ["loading plan", child.line(), "[htp] built 252 graphs"]
    assert bench.description.startswith("npumoe build (lowering: 12/252 graphs, ~")
    assert bench.description.endswith(" left), measured in its own process")
    assert "elapsed" not in bench.description  # the bench's own line says its time spent
