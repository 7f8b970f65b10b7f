"""A content-addressed cache of lowered build units, so a real-size build resumes and rebuilds only what changed.

A unit is what a backend compiles in one go (the HTP: one graph; the ANE: one package of
graphs). Its key hashes everything the result depends on: the graphs' IR, the bytes of the
weights they read, the backend's description (target, precision, SoC, toolchain versions)
and anything else the backend names (the HTP's calibration feeds). A unit is lowered into
a temporary directory inside the cache and renamed into place only when complete, so a
build killed halfway leaves every finished unit cached and none half-written; rerunning
it links the finished units into the new artifact directory and compiles the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from npumoe.core.ir import Graph
from npumoe.core.native import cache_dir

ENTRY = "entry.json"
VERSION = 1  # bump when what a key covers changes


def graph_fingerprint(graph: Graph) -> dict:
    """The graph's IR as plain data (its name included: artifacts are filed under it)."""
    return {"name": graph.name, "kind": graph.kind, "layer": graph.layer,
            "inputs": {n: dataclasses.astuple(t) for n, t in graph.inputs.items()},
            "outputs": {n: dataclasses.astuple(t) for n, t in graph.outputs.items()},
            "ops": [[op.op, op.inputs, op.outputs, [[k, repr(v)] for k, v in op.attrs]] for op in graph.ops]}


def unit_key(graphs: list[Graph], weights, backend_description: dict, extra=None) -> str:
    """The key of a unit compiling ``graphs``: IR, weight bytes, backend, and ``extra`` (JSON-able)."""
    from npumoe.core.weights import weights_digest

    names = sorted({n for g in graphs for n in g.weight_names()})
    text = json.dumps({"version": VERSION, "graphs": [graph_fingerprint(g) for g in graphs],
                       "weights": weights_digest(weights, names), "backend": backend_description, "extra": extra},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class BuildCache:
    """``unit(key, out_dir, lower)``: the unit's manifest entries, from the cache or lowered now.

    It lives in ``$NPUMOE_BUILD_CACHE`` (default ``~/.cache/npumoe/builds``) and only grows:
    delete the directory to reclaim its space."""

    def __init__(self, root: Path | None = None):
        if root is None:
            root = os.environ.get("NPUMOE_BUILD_CACHE") or cache_dir("builds")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def unit(self, key: str, out_dir: Path, lower: Callable[[Path], dict]) -> dict:
        """``lower(dir)`` writes the unit's files under ``dir`` and returns its entries (graph name →
        entry, paths relative to ``dir``); each entry gains ``seconds`` (compile time) and ``cached``."""
        done = self.root / key
        if (done / ENTRY).is_file():
            self.hits += 1
            entries = json.loads((done / ENTRY).read_text())
            cached = True
        else:
            self.misses += 1
            work = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{key}."))
            try:
                start = time.perf_counter()
                entries = lower(work)
                seconds = (time.perf_counter() - start) / max(len(entries), 1)
                entries = {name: {**e, "seconds": round(seconds, 3)} for name, e in entries.items()}
                (work / ENTRY).write_text(json.dumps(entries, sort_keys=True))
                for path in work.rglob("*"):  # shared by hard links with every artifact: never edited in place
                    if path.is_file():
                        path.chmod(0o444)
                try:
                    work.rename(done)
                except OSError:  # another build finished the same unit first: theirs is as good
                    shutil.rmtree(work, ignore_errors=True)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            cached = False
        _link_tree(done, Path(out_dir))
        return {name: {**e, "cached": cached} for name, e in entries.items()}


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link (copy across file systems) every file of ``src`` but its entry into ``dst``."""
    for path in src.rglob("*"):
        if path.is_dir() or path.name == ENTRY:
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
