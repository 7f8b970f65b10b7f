"""A content-addressed cache of lowered build units, so a real-size build resumes and rebuilds only what changed.

A unit is what a backend compiles in one go (the HTP: one graph; the ANE: one package of
graphs). Its key hashes everything the result depends on: the graphs' IR, the bytes of the
weights they read, the backend's description (target, precision, SoC, toolchain versions),
npumoe's own source code, and anything else the backend names (the HTP's calibration feeds).
A unit is lowered into a temporary directory inside the cache and renamed into place only when complete, so a
build killed halfway leaves every finished unit cached and none half-written; rerunning
it links the finished units into the new artifact directory and compiles the rest.

Artifacts stay hard links into the cache (copies where the cache is on another file system): a real-size build
is gigabytes, and copying it would double its disk and time. Linked files are read-only, and damage that gets
through (a chmod, a tool writing in place: through one link it is in every link) is caught on both sides: the
artifact directory's manifest no longer verifies, and the cache checks every file of an entry against the size
and sha256 recorded in its ``entry.json`` before linking it again, lowering the unit afresh on any mismatch, so
a damaged file is never linked into, and signed by, a new manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from npumoe.core.base.errors import InputError
from npumoe.core.base.io import sha256_file
from npumoe.core.base.native import cache_dir
from npumoe.core.base.outputs import temporary_directory
from npumoe.core.base.progress import Task
from npumoe.core.ir.graph import Graph

ENTRY = "entry.json"
VERSION = 1  # bump when what a key covers changes


def graph_fingerprint(graph: Graph) -> dict:
    """The graph's IR as plain data (its name included: artifacts are filed under it)."""
    return {"name": graph.name, "kind": graph.kind, "layer": graph.layer,
            "inputs": {n: dataclasses.astuple(t) for n, t in graph.inputs.items()},
            "outputs": {n: dataclasses.astuple(t) for n, t in graph.outputs.items()},
            "ops": [[op.op, op.inputs, op.outputs, [[k, repr(v)] for k, v in op.attrs]] for op in graph.ops]}


@functools.cache
def code_digest() -> str:
    """A hash of npumoe's own sources (Python and C): a lowering changed by an upgrade, or by an edit in a
    development checkout, must not be answered with what the old code built."""
    import npumoe.backends
    import npumoe.core
    import npumoe.luts

    digest = hashlib.sha256()
    for root in (Path(p) for pkg in (npumoe.core, npumoe.backends, npumoe.luts) for p in pkg.__path__):
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def unit_key(graphs: list[Graph], weights, backend_description: dict, extra=None) -> str:
    """The key of a unit compiling ``graphs``: IR, weight bytes, backend, npumoe's code, and ``extra`` (JSON-able)."""
    from npumoe.core.ir.weights import weights_digest

    names = sorted({n for g in graphs for n in g.weight_names()})
    text = json.dumps({"version": VERSION, "code": code_digest(), "graphs": [graph_fingerprint(g) for g in graphs],
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

    def has(self, key: str) -> bool:
        return (self.root / key / ENTRY).is_file()

    def fill(self, key: str, lower: Callable[[Path], dict]) -> tuple[dict, bool]:
        """The unit's entries and whether they came from the cache; ``lower(dir)`` writes the unit's files
        under ``dir`` and returns its entries (graph name → entry, paths relative to ``dir``), each of
        which gains ``seconds`` (compile time). A cached unit whose files fail verification is lowered again."""
        if (cached := self.verified(key)) is not None:
            self.hits += 1
            return cached, True
        with self._lowering(key):
            return self._fill_locked(key, lower)

    @contextlib.contextmanager
    def _lowering(self, key: str):
        """One process lowers a unit at a time: another asking for it waits, then links what the first stored
        (two builds, or two test workers sharing a cache, never compile the same unit at once)."""
        with open(self.root / f".{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _fill_locked(self, key: str, lower: Callable[[Path], dict]) -> tuple[dict, bool]:
        done = self.root / key
        if (cached := self.verified(key)) is not None:  # lowered by whoever held the lock before us
            self.hits += 1
            return cached, True
        if done.exists():  # damaged, or from before files were recorded: replaced, never linked again
            _remove(done, self.root)
        self.misses += 1
        work = temporary_directory(self.root, f".{key}.")
        try:
            start = time.perf_counter()
            entries = lower(work)
            seconds = (time.perf_counter() - start) / max(len(entries), 1)
            entries = {name: {**e, "seconds": round(seconds, 3)} for name, e in entries.items()}
            (work / ENTRY).write_text(json.dumps({"entries": entries, "files": _file_records(work)}, sort_keys=True))
            for path in work.rglob("*"):  # shared by hard links with every artifact: never edited in place
                if path.is_file():
                    path.chmod(path.stat().st_mode & 0o555)  # read-only, readable by whom the umask lets read
            try:
                work.rename(done)
            except OSError:  # another build finished the same unit first: theirs is as good
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return entries, False

    def verified(self, key: str) -> dict | None:
        """The cached unit's entries if every file its entry.json records is there with the recorded size and
        sha256 (sizes first: a truncated file fails unread) and no other file is; else None."""
        done = self.root / key
        try:
            recorded = json.loads((done / ENTRY).read_text())
            files, entries = recorded["files"], recorded["entries"]
            if sorted(files) != sorted(_unit_files(done)):
                return None
            if any((done / rel).stat().st_size != size for rel, (size, _) in files.items()):
                return None
            if any(sha256_file(done / rel) != digest for rel, (_, digest) in files.items()):
                return None
            return entries
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def unit(self, key: str, out_dir: Path, lower: Callable[[Path], dict]) -> dict:
        """The unit's manifest entries, from the cache or lowered now, its files linked into ``out_dir``;
        each entry says whether it was ``cached``."""
        entries, cached = self.fill(key, lower)
        _link_tree(self.root / key, Path(out_dir))
        return {name: {**e, "cached": cached} for name, e in entries.items()}


@dataclasses.dataclass(frozen=True)
class BuildUnit:
    """What a backend compiles in one go: its cache key, its graphs, and how to lower them into a directory."""

    key: str
    graphs: list[Graph]
    lower: Callable[[Path], dict]

    @property
    def label(self) -> str:
        return self.graphs[0].name if len(self.graphs) == 1 else f"{self.graphs[0].name} (+{len(self.graphs) - 1})"


_FORKED: list[BuildUnit] = []  # the units forked workers lower, by index: a unit's closure does not pickle


def _worker_start(parent: int) -> None:
    """A forked worker computes on one thread: torch's OpenMP pool does not survive a fork (its first
    parallel op would hang), and one thread a process is what ``jobs`` asks for anyway. It dies with its
    ``parent``: a killed build must not leave workers compiling for minutes, holding the caller's terminal."""
    import torch

    torch.set_num_threads(1)
    die_with_parent(parent)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies (Linux; elsewhere the pool's own shutdown is all)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def _lower_forked(index: int) -> None:
    BuildCache().fill(_FORKED[index].key, _FORKED[index].lower)


def lower_units(units: list[BuildUnit], out_dir: Path, step: Task, jobs=1) -> dict[str, dict]:
    """Every unit's entries, its files linked into ``out_dir``, each unit's graphs counted on ``step``. With
    ``jobs`` > 1 the units not yet cached are lowered first by that many forked processes (each fills the cache;
    a fork shares the mapped weights), or, ``jobs`` a cluster (:class:`npumoe.backends.ray_cluster.RayCluster`),
    on its nodes; then all are linked in order; a worker's error stops the build with that error."""
    cache, fresh, title = BuildCache(), set(), step.description
    todo = [u for u in units if not cache.has(u.key)] if jobs != 1 else []
    if todo and not isinstance(jobs, int):
        fresh = jobs.fill(todo, cache.root, step)
    elif todo:
        _FORKED[:] = todo
        try:
            with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("fork"),
                                     initializer=_worker_start, initargs=(os.getpid(),)) as pool:
                step.describe(f"{title}: {len(todo)} units on {min(jobs, len(todo))} processes")
                running = {pool.submit(_lower_forked, i): u for i, u in enumerate(todo)}
                try:
                    for done in as_completed(running):
                        done.result()
                        fresh.add(running[done].key)
                        step.advance(len(running[done].graphs))
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)  # a failed unit fails the build: stop now
                    raise
        except BrokenProcessPool as err:
            raise InputError(f"a build process died ({err}), most likely out of memory: each of the {jobs} jobs "
                             "holds one unit's weights while it compiles; build again with fewer --jobs (units "
                             "finished so far are cached).") from err
        finally:
            _FORKED.clear()
    entries = {}
    for u in units:
        if u.key not in fresh:
            step.describe(f"{title}: {u.label}")
        unit = cache.unit(u.key, out_dir, u.lower)
        if u.key in fresh:
            unit = {name: {**e, "cached": False} for name, e in unit.items()}
        else:
            step.advance(len(u.graphs))
        entries |= unit
    return entries


def _unit_files(unit_dir: Path) -> list[str]:
    """The unit's own files (its entry.json aside), relative to its directory."""
    return sorted(str(p.relative_to(unit_dir)) for p in unit_dir.rglob("*") if p.is_file() and p != unit_dir / ENTRY)


def _file_records(unit_dir: Path) -> dict[str, tuple[int, str]]:
    """Size and sha256 of each of the unit's files, as its entry.json records them."""
    return {rel: ((unit_dir / rel).stat().st_size, sha256_file(unit_dir / rel)) for rel in _unit_files(unit_dir)}


def _remove(unit_dir: Path, root: Path) -> None:
    """Move a unit out of the way first (a rename is atomic: no build sees it half deleted), then delete it."""
    doomed = temporary_directory(root, ".removed.") / unit_dir.name
    try:
        unit_dir.rename(doomed)
    except OSError:  # another build removed or replaced it first
        pass
    shutil.rmtree(doomed.parent, ignore_errors=True)


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link (copy across file systems) every file of ``src`` but its entry into ``dst``."""
    for rel in _unit_files(src):
        path, target = src / rel, dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
