"""The demo model's corpus: Python's own standard library, so nothing is ever downloaded.

Documents are the stdlib's ``.py`` files (site-packages, test directories and files over
200 KB left out), in sorted path order, then the topics of ``pydoc_data.topics`` in sorted
key order. The split is by document: a file whose relative path (a topic whose key) has
sha256 ≡ 0 mod 20 is held out, so held-out text is never seen in training, not even in part.
The corpus depends on the Python version's stdlib; train.py records a sha256 of its bytes.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MAX_FILE_BYTES = 200_000
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test",  # test/, idlelib/idle_test, lib2to3/tests, ...
             "__pycache__"}
HELD_OUT_MOD = 20


def is_held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % HELD_OUT_MOD == 0


def documents() -> Iterator[tuple[str, str, str]]:
    """(name, split key, text) for every document, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if path.stat().st_size <= MAX_FILE_BYTES:
            yield f"stdlib/{rel}", rel, path.read_text(encoding="utf-8", errors="replace")
    import pydoc_data.topics

    for key, text in sorted(pydoc_data.topics.topics.items()):
        yield f"pydoc/{key}", key, text


def split(max_files: int | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(train, held-out) name → text. ``max_files`` keeps the first N documents of each side."""
    train: dict[str, str] = {}
    held: dict[str, str] = {}
    for name, key, text in documents():
        side = held if is_held_out(key) else train
        if max_files is None or len(side) < max_files:
            side[name] = text
        if max_files is not None and len(train) >= max_files and len(held) >= max_files:
            break
    return train, held


def to_bytes(texts: dict[str, str]) -> bytes:
    """The byte stream a split is trained or evaluated on: documents joined by a blank line."""
    return b"\n\n".join(t.encode("utf-8", errors="replace") for t in texts.values())


def digest(texts: dict[str, str]) -> str:
    return hashlib.sha256(to_bytes(texts)).hexdigest()


def calibration_texts(limit: int = 40) -> list[str]:
    """A fixed slice of the training split: what npumoe calibrate sees for the demo model."""
    train, _ = split()
    return [t for _, t in list(train.items())[:: max(1, len(train) // limit)][:limit]]


def heldout_texts(limit: int = 40) -> list[str]:
    _, held = split()
    return list(held.values())[:limit]
