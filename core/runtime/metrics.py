"""Counters and per-op timers the engine keeps; ``Engine.metrics`` is a plain dict of them. ``threaded`` metrics
take a lock for each update: a MoE layer's NPU launches may run on a worker thread beside its CPU experts (a
decode step updates them some sixty times, so engines without that worker skip the lock)."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

COUNTS = ("routed", "padded", "spilled", "dropped", "rerouted", "npu_launches", "cpu_launches",
          "executor_hits", "executor_misses", "prefetches", "prefetch_hits", "evictions",
          "weight_bytes")  # weights the executors read: each call reads its graph's (a whole group's, on an NPU)


class Metrics:
    def __init__(self, threaded: bool = False):
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.seconds: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] | None = None  # set to [] to record a timeline (--trace)
        self.graph_runs: Counter[str] = Counter()  # calls per graph (CPU experts as L{layer}.cpu.e{expert})
        self.lock = threading.Lock() if threaded else None

    def running(self, graphs: list[str]) -> _Timer:
        """``with metrics.running(graphs):`` counts a call of each graph and times it as ``executor`` (the rest
        of a step's time is host work)."""
        self.count_runs(graphs)
        return self.time("executor")

    def count_runs(self, graphs: list[str]) -> None:
        if self.lock is None:
            self.graph_runs.update(graphs)
        else:
            with self.lock:
                self.graph_runs.update(graphs)

    def record(self, op: str, start: float, end: float) -> None:
        """Add ``op``'s time from ``start`` to ``end`` (perf_counter seconds), as ``time`` would have timed it: for a
        call that reports how its time splits between host work and executors."""
        timer = _Timer(self, op)
        timer.start = start
        timer.finish(end)

    def add(self, name: str, n: int = 1) -> None:
        if self.lock is None:
            self.counts[name] = self.counts.get(name, 0) + int(n)
        else:
            with self.lock:
                self.counts[name] = self.counts.get(name, 0) + int(n)

    def time(self, op: str) -> _Timer:
        """``with metrics.time(op):`` adds the block's wall time to ``seconds[op]`` (and a span when recording)."""
        return _Timer(self, op)

    def as_dict(self) -> dict:
        return {**self.counts, "seconds": dict(self.seconds)}

    def reset(self) -> None:
        self.__init__(threaded=self.lock is not None)


class _Timer:
    """A plain context manager: a decode step enters some forty of them, and a generator-based one costs
    several times more host time each."""

    __slots__ = ("metrics", "op", "start")

    def __init__(self, metrics: Metrics, op: str):
        self.metrics, self.op = metrics, op

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.finish(time.perf_counter())

    def finish(self, end: float) -> None:
        if self.metrics.lock is None:
            self._record(end)
        else:
            with self.metrics.lock:
                self._record(end)

    def _record(self, end: float) -> None:
        self.metrics.seconds[self.op] += end - self.start
        if self.metrics.spans is not None:
            self.metrics.spans.append((self.op, self.start, end))
