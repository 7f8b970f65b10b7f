"""The HTP's profile in ``npumoe generate --trace`` (:mod:`npumoe.core.tools.trace` writes the timeline).

Two synthetic threads beside the host's, as in the QNN runtime notes this follows:

* ``HTP graphs``: every graph launch, host-timed around ``session.run``, with the HTP's
  accelerator cycles and QNN execute time for that run in its args;
* ``HTP ops``: each launch's per-node cycles (``profiling_level=detailed``) laid end to end
  inside the launch, widths proportional to cycles (the x86 HTP is a software model, so its
  cycles are the device's count but its wall time is not the device's).

QNN writes one CSV per session and appends one block per run; run *k* of a graph's CSV is
its *k*-th launch.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

RUN_START = "Accelerator (execute) time (cycles)"
RUN_END = "QNN (execute) time"


@dataclass
class HtpRun:
    cycles: int = 0
    execute_us: int = 0
    nodes: list[tuple[str, int]] = field(default_factory=list)


def read_profile(path: Path) -> list[HtpRun]:
    """The runs in one session's QNN profile CSV, in order."""
    runs: list[HtpRun] = []
    current = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            what, value = row["Event Identifier"], int(float(row["Time"]))
            if what == RUN_START:
                current = HtpRun(cycles=value)
            elif current is not None and row["Message"] == "NODE":
                current.nodes.append((what.removesuffix(" (cycles)"), value))
            elif current is not None and what == RUN_END:
                current.execute_us = value
                runs.append(current)
                current = None
    return runs


def htp_executors(engine) -> list:
    from npumoe.backends.qualcomm_htp.executor import HtpExecutor

    return [e for e in engine.executors.resident() if isinstance(e, HtpExecutor) and e.profile_csv is not None]


def graph_cycles(engine) -> dict[str, dict]:
    """Per profiled graph: launches and mean accelerator cycles per launch."""
    out = {}
    for ex in htp_executors(engine):
        runs = read_profile(ex.profile_csv) if Path(ex.profile_csv).exists() else []
        if runs:
            out[ex.graph_name] = {"launches": len(runs), "mean_cycles": sum(r.cycles for r in runs) // len(runs),
                                  "mean_execute_us": sum(r.execute_us for r in runs) // len(runs)}
    return out


class HtpTrace:
    """The HTP's part of ``npumoe generate --trace`` (:class:`~npumoe.core.ir.backend.DeviceTrace`)."""

    def backend_options(self, trace_path: Path) -> dict:
        """QNN writes its per-session profile CSVs beside the trace, kept for QNN's own tools."""
        return {"profile_dir": str(Path(trace_path).with_suffix("")) + "_htp_profile"}

    def spans(self, engine) -> tuple[list[tuple[str, str, str, float, float, dict]], dict]:
        spans = []
        for ex in htp_executors(engine):
            runs = read_profile(ex.profile_csv) if Path(ex.profile_csv).exists() else []
            for run, (a, b) in zip(runs, ex.launches):
                spans.append(("HTP graphs", ex.graph_name, "htp", a, b,
                              {"accelerator_cycles": run.cycles, "qnn_execute_us": run.execute_us}))
                total, start = sum(c for _, c in run.nodes) or 1, a
                for node, cycles in run.nodes:  # laid end to end inside the launch, widths by cycles
                    end = start + (b - a) * cycles / total
                    spans.append(("HTP ops", node, "htp_op", start, end, {"cycles": cycles, "graph": ex.graph_name}))
                    start = end
        return spans, {"htp_graph_cycles": graph_cycles(engine)}
