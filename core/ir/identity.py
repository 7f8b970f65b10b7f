"""Which weights a profile, plan or built artifact was made from.

The spec fingerprint (:meth:`~npumoe.core.ir.spec.ModelSpec.fingerprint`) names an architecture, and a
fine-tune shares it with its base model; an artifact compiled from the base would run for the fine-tune
and print the base model's text. So profiles, plans and artifacts also record a fingerprint of the
weights, and are refused for a model whose weights differ.

Real checkpoints are 10-60 GB, so the default ``fast`` fingerprint hashes each safetensors file's
header (every tensor's name, dtype, shape and offsets), its size, and a fixed sample of its data:
``SAMPLES`` pages of ``PAGE`` bytes spread evenly over it (all of it when the data is that small). A
fine-tune changes nearly every page, so sampling catches it; an edit that touches only unsampled bytes
of a large file does not, and ``NPUMOE_WEIGHTS_HASH=full`` hashes every byte instead. A fingerprint
says which mode made it, and is checked in that mode. Each file's digest is cached under
``$NPUMOE_CACHE_DIR/fingerprints`` (default ``~/.cache/npumoe``) keyed by its path, size and mtime, so
repeated commands read nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.io import atomic_write_text

MODES = ("fast", "full")
SAMPLES = 64
PAGE = 64 << 10
ENV = "NPUMOE_WEIGHTS_HASH"
VERSION = "npumoe-weights-1"


def default_mode() -> str:
    """The mode new fingerprints are made in: ``$NPUMOE_WEIGHTS_HASH`` or ``fast``."""
    mode = os.environ.get(ENV, "fast")
    if mode not in MODES:
        raise InputError(f"{ENV}={mode!r} is not a weights hash mode; use {' or '.join(MODES)}.")
    return mode


def mode_of(fingerprint: str) -> str:
    """A recorded fingerprint's mode: ``full`` ones carry the prefix ``full-``."""
    return "full" if fingerprint.startswith("full-") else "fast"


def weights_fingerprint(files: list[Path], mode: str) -> str:
    """A short id of the weights in ``files`` (their names, headers and data, see the module docstring)."""
    h = hashlib.sha256(f"{VERSION} {mode}".encode())
    for path in sorted(files, key=lambda p: p.name):
        h.update(f"{path.name} {file_digest(path, mode)}\n".encode())
    return ("full-" if mode == "full" else "") + h.hexdigest()[:16]


def file_digest(path: Path, mode: str) -> str:
    """One file's digest in ``mode``, from the cache when its path, size and mtime are unchanged."""
    stat = path.stat()
    key = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    entry = _cache_file(key["path"])
    cached = _read_cache(entry)
    if any(cached.get(k) != v for k, v in key.items()):
        cached = {}  # another file now, or changed since: its digests no longer hold
    if mode not in cached:
        cached = {**cached, **key, mode: _hash_file(path, stat.st_size, mode)}
        try:
            atomic_write_text(entry, json.dumps(cached))
        except OSError:
            pass  # a read-only cache only costs the next command the same reads
    return cached[mode]


def _read_cache(entry: Path) -> dict:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cache_file(resolved: str) -> Path:
    from npumoe.core.base.native import cache_dir

    return cache_dir("fingerprints") / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".json")


def _hash_file(path: Path, size: int, mode: str) -> str:
    """sha256 of the size, the header and the data (every byte in ``full`` mode, else the sampled pages)."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        start = len(head) + min(header_len, max(size - len(head), 0))
        h.update(head + f.read(start - len(head)))
        for offset, length in _data_ranges(start, size, mode):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def _data_ranges(start: int, end: int, mode: str) -> list[tuple[int, int]]:
    """(offset, length) pieces of the data ``[start, end)`` to hash: all of it in blocks, or SAMPLES pages
    evenly spaced from its first to its last byte (fixed, so every run reads the same pages)."""
    data = end - start
    if mode == "full" or data <= SAMPLES * PAGE:
        return [(o, min(PAGE * 16, end - o)) for o in range(start, end, PAGE * 16)]
    step = (data - PAGE) / (SAMPLES - 1)
    return [(start + round(k * step), PAGE) for k in range(SAMPLES)]


def check_weights(recorded: str | None, model, what: str, made_by: str, fix: str, required: bool = False) -> None:
    """Refuse ``what`` (a plan, profile or artifact) made from weights other than ``model``'s, naming both
    and ``fix``. ``recorded`` is None in files written before weights were recorded: refused when
    ``required`` (artifacts, which hold compiled weights), else accepted on the spec check alone."""
    if recorded is None:
        if required:
            raise ArtifactError(f"{what} records no weights fingerprint: it was made by an earlier npumoe, which "
                                f"checked the config only; {fix} with this version.")
        return
    current = model.weights_fingerprint(mode_of(recorded))
    if recorded != current:
        raise ArtifactError(f"{what} was made from other weights ({made_by}, weights {recorded}) than {model.name}'s "
                            f"(weights {current}), though the architecture is the same; {fix}.")
