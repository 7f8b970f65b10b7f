"""Executors kept within a memory budget: loaded on first use, least recently used evicted first.

A phone cannot hold every compiled expert graph of a 30 B model at once; the NPU's loaded graphs
(context binaries, Core ML models) are a cache over the artifacts on flash. ``max_resident_bytes``
is that cache's size. Room is made before a load, so the loaded graphs' bytes stay within it (a graph
larger than the whole budget still runs: it is loaded alone, run, and the next load evicts it). A
device that runs out of memory first (:class:`~npumoe.core.ir.backend.DeviceMemoryFull`) sets the budget to
what it held: without a budget, the engine loads every graph until then and the rest on demand. Evicted
executors are closed, so the device frees them. Prefetching loads a graph before its step needs it (during
the previous attention, on a device), so the step finds it resident.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping

from npumoe.core.base.errors import InputError
from npumoe.core.base.progress import track
from npumoe.core.ir.backend import DeviceMemoryFull, Executor
from npumoe.core.runtime.metrics import Metrics


class ResidentExecutors(MutableMapping[str, Executor]):
    """A mapping of graph name → executor whose values are loaded when asked for and evicted (least recently
    used first) while the resident ones' bytes exceed ``budget`` (None: no limit, nothing evicted). Metrics count
    ``executor_hits``, ``executor_misses`` (a load on demand), ``prefetches``, ``prefetch_hits`` (a prefetched
    graph used before its eviction), ``evictions`` and ``device_full`` (loads the device refused for memory);
    ``resident_bytes`` peaks as ``peak_resident_bytes``."""

    def __init__(self, loaders: dict[str, Callable[[], Executor]], sizes: dict[str, int], budget: int | None,
                 metrics: Metrics):
        self._loaders, self.sizes, self.budget, self.metrics = dict(loaders), sizes, budget, metrics  # bytes per graph
        self._resident: OrderedDict[str, Executor] = OrderedDict()  # least recently used first
        self._prefetched: set[str] = set()
        self.resident_bytes = 0

    def __getitem__(self, name: str) -> Executor:
        if self.budget is None:  # everything loaded at start: nothing to count or reorder on the hot path
            return self._resident[name]
        if name in self._resident:
            self._resident.move_to_end(name)
            self.metrics.add("executor_hits")
            if name in self._prefetched:
                self._prefetched.discard(name)
                self.metrics.add("prefetch_hits")
            return self._resident[name]
        if name not in self._loaders:
            raise KeyError(name)
        self.metrics.add("executor_misses")
        return self._load(name)

    def prefetch(self, names) -> None:
        """Load the named graphs that are not resident (most likely first: a later one may evict an earlier
        one when the budget is small)."""
        for name in names:
            if name not in self._resident and name in self._loaders:
                self.metrics.add("prefetches")
                self._load(name)
                self._prefetched.add(name)

    def load_all(self) -> None:
        """Every graph, now, or as many as the device holds: without a budget, the engine loads all at start so
        that a damaged artifact is named before the first token rather than in the middle of a run."""
        for name in track([n for n in self._loaders if n not in self._resident], "loading graphs", "graphs"):
            if self.budget is not None:  # the device filled up: the rest load on demand
                return
            self._load(name)

    def _load(self, name: str) -> Executor:
        size = self.sizes.get(name, 0)
        while True:
            self._evict(room=size)
            try:
                executor = self._loaders[name]()
                break
            except DeviceMemoryFull as err:
                self.metrics.add("device_full")
                if not self._resident:
                    raise InputError(f"graph {name} ({size / 1e6:.4g} MB) does not fit the device's memory even with "
                                     f"every other graph unloaded ({err}); build it at a lower --precision or a "
                                     "smaller --chunk.") from None
                self.budget = self.resident_bytes  # what the device held; room for this graph is made from it
        self._resident[name] = executor
        self.resident_bytes += size
        self.metrics.counts["peak_resident_bytes"] = max(self.metrics.counts.get("peak_resident_bytes", 0),
                                                         self.resident_bytes)
        return executor

    def _evict(self, room: int) -> None:
        """Unload the least recently used graphs until ``room`` more bytes fit the budget."""
        while self.budget is not None and self._resident and self.resident_bytes + room > self.budget:
            name, executor = self._resident.popitem(last=False)
            self._prefetched.discard(name)
            self.resident_bytes -= self.sizes.get(name, 0)
            self.metrics.add("evictions")
            if close := getattr(executor, "close", None):
                close()

    def __setitem__(self, name: str, executor: Executor) -> None:
        """Replace a graph's executor (a test or a tracer wrapping it); it stays the one loaded from now on."""
        self._loaders[name] = lambda: executor
        if name in self._resident:
            self._resident[name] = executor

    def __delitem__(self, name: str) -> None:
        raise TypeError("graphs cannot be removed from a program's executors")

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def resident(self) -> list[Executor]:
        """The executors loaded now (iterating the mapping's values would load every graph)."""
        return list(self._resident.values())
