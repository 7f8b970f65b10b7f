"""Counters and per-op timers the engine keeps; ``Engine.metrics`` is a plain dict of them."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager

COUNTS = ("routed", "padded", "spilled", "dropped", "rerouted", "npu_launches", "cpu_launches")


class Metrics:
    def __init__(self):
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.seconds: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] | None = None  # set to [] to record a timeline (--trace)
        self.graph_runs: Counter[str] = Counter()  # calls per graph (CPU experts as L{layer}.cpu.e{expert})

    @contextmanager
    def running(self, graphs: list[str]):
        """Time executor calls as ``executor`` (everything else a step spends is host work) and count them."""
        self.graph_runs.update(graphs)
        with self.time("executor"):
            yield

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + int(n)

    @contextmanager
    def time(self, op: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[op] += end - start
            if self.spans is not None:
                self.spans.append((op, start, end))

    def as_dict(self) -> dict:
        return {**self.counts, "seconds": dict(self.seconds)}

    def reset(self) -> None:
        self.__init__()
