"""Writing files so that a crash never leaves half of one, and reading our own JSON artifacts."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.outputs import OutputKind, claimed, staging_prefix, temporary_file, undone_on_failure


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write to a temporary file beside ``path``, then rename over it (a killed run's temporary is removed
    by the next :func:`~npumoe.core.base.outputs.claim` of the same path); the file gets the mode a plain
    ``open()`` would give it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_file(path.parent, staging_prefix(path), ".tmp")
    with undone_on_failure(path, lambda: Path(tmp).unlink(missing_ok=True)):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


def write_output(path: str | Path, kind: OutputKind, data: bytes | str, option: str = "--out") -> Path:
    """Write a whole one-file output (a plan, a profile, a figure, a trace, a report): claimed, then atomic."""
    with claimed(path, kind, option) as path:
        return atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MB blocks (artifacts and cached binaries are checked by it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_json(value) -> str:
    """Hex sha256 of a JSON value in one canonical spelling (sorted keys, no spaces), so the value read back
    from a file hashes as it did when written, however the file was indented."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json_artifact(path: str | Path, kind: str, made_by: str) -> dict:
    """Read a JSON file npumoe wrote, checking its ``kind`` so a plan is never read as a profile."""
    path = existing_file(path, made_by)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path} is not valid JSON ({err}); expected {made_by}.") from err
    except OSError as err:
        raise InputError(f"{path} cannot be read ({err.strerror}); expected {made_by}.") from err
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise ArtifactError(f"{path} is not {made_by} "
                            f"(its kind is {data.get('kind') if isinstance(data, dict) else None!r}).")
    return data


def existing_file(path: str | Path, expected: str) -> Path:
    """``path`` if it is a file; otherwise say whether it is missing or a directory (both are common slips)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a file; expected {expected}.")
    if not path.is_file():
        raise InputError(f"{path} does not exist; expected {expected}.")
    return path
