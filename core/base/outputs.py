"""Where a command may write: a new path, or an earlier npumoe output of the same kind, nothing else.

Every command that writes a path (build, quantize, calibrate, plan, plots, traces) calls
:func:`claim` before any work starts, so a mistyped ``--out`` never deletes the user's own files
and an unwritable one fails in the first second instead of after minutes of work. Files are
written to a temporary sibling and renamed; directories are produced in a staging sibling and
swapped in when complete. One process at a time writes a path: :func:`claim` takes a lock beside it, and a
second writer is refused naming the first. Temporaries carry the writer's process id, so the next run that writes
the same path removes what a killed run left behind, and never what a live one is writing. They are
created as a plain ``open()`` or ``mkdir`` would create the output itself, under the user's umask (tempfile's
are private, 0600 and 0700, and would stay so once renamed into place).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from npumoe.core.base.errors import InputError

STAGING_TAG = "npumoe"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
ASIDE = "old"  # the suffix of an earlier output moved aside while its replacement is renamed in


@dataclass(frozen=True)
class OutputKind:
    """What a command writes: its name in messages, file or directory, and how an earlier one is recognised."""

    name: str
    directory: bool
    recognise: Callable[[Path], bool]


def json_object(path: Path) -> dict:
    """The JSON object in ``path``, or {} when it is missing, unreadable or not an object: recognisers only
    need to know whether a marker is there."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def json_kind(kind: str) -> Callable[[Path], bool]:
    """A recogniser for JSON files whose top-level ``kind`` is ``kind`` (profiles, plans, manifests)."""
    return lambda path: json_object(path).get("kind") == kind


def claim(path: str | Path, kind: OutputKind, option: str = "--out") -> Path:
    """Check before any work that ``path`` may be written as ``kind``: refuse anything that is not new or an
    earlier output of the same kind, any location that cannot be written, and a path another process is writing;
    tidy a killed run's leftovers. The claim holds until :func:`release` (:func:`claimed` releases it when the
    write ends) or the process exits."""
    path = Path(path)
    absolute = Path(os.path.abspath(path))  # "." has no name to put a lock or staging beside
    if not absolute.name:
        raise InputError(f"{option} {path} is the file system's root; give a path under it.")
    if Path.cwd().is_relative_to(absolute):  # replacing it would pull the directory out from under the user
        raise InputError(f"{option} {path} holds the current directory; give a path inside it, such as ./out.")
    _check_writable(path, option)
    absolute.parent.mkdir(parents=True, exist_ok=True)  # the lock lives beside the output
    _lock(absolute, option)
    try:
        remove_stale_staging(absolute)
        _refuse_foreign(path, kind, option)
    except BaseException:
        release(absolute)
        raise
    return path


@contextmanager
def claimed(path: str | Path, kind: OutputKind, option: str = "--out") -> Iterator[Path]:
    """:func:`claim` for the length of a block that writes ``path``, released however the block ends."""
    path = claim(path, kind, option)
    absolute = Path(os.path.abspath(path))  # released where it was taken, whatever the block does to the cwd
    try:
        yield path
    finally:
        release(absolute)


_HELD: dict[str, tuple[int, int]] = {}  # lock file → (pid, open descriptor), for each output claimed here


def lock_file(path: Path) -> Path:
    """The lock beside ``path`` that one writer at a time holds (flock), holding its pid for the others' message."""
    path = Path(os.path.abspath(path))
    return path.with_name(f".{path.name}.{STAGING_TAG}-lock")


def _lock(path: Path, option: str) -> None:
    """Take ``path``'s lock, or refuse naming the process that holds it. A lock removed by its releasing holder
    while this one opened it is taken afresh: only the file at the lock's name counts."""
    lock = lock_file(path)
    key = os.path.realpath(lock)
    while key not in _HELD:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise InputError(f"{option} {path} is being written by another npumoe process"
                             f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to finish, or choose "
                             "another path.") from None
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if not current:
            os.close(fd)
            continue
        _HELD[key] = os.getpid(), fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # a full disk: the lock holds without the pid the others' message would name
            pass


def release(path: str | Path) -> None:
    """Give up this process's claim on ``path`` (nothing if it holds none): the lock file goes, then the lock."""
    _unlock(os.path.realpath(lock_file(Path(path))))


def _unlock(lock: str) -> None:
    owner, fd = _HELD.pop(lock, (None, None))
    if owner == os.getpid():  # a forked child shares its parent's lock, and leaves it to the parent
        Path(lock).unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)


@atexit.register
def _release_all() -> None:
    """A process that exits holding claims (a command refused after its early claim) leaves no lock files."""
    for lock in list(_HELD):
        _unlock(lock)


def _refuse_foreign(path: Path, kind: OutputKind, option: str) -> None:
    """Only an empty directory or an earlier output of the same kind may be replaced."""
    if kind.directory and path.exists() and not path.is_dir():
        raise InputError(f"{option} {path} is a file, and npumoe will not replace it with {kind.name}; give a "
                         "directory path.")
    if not kind.directory and path.is_dir():
        raise InputError(f"{option} {path} is a directory; give a file path for {kind.name}.")
    empty_dir = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty_dir and not kind.recognise(path):
        what = "holds files that are" if path.is_dir() else "exists and is"
        raise InputError(f"{option} {path} {what} not {kind.name}, so npumoe will not replace it; choose a new "
                         "path (or remove it yourself).")


def _check_writable(path: Path, option: str) -> None:
    """Create and remove a file where the output will go (its nearest existing ancestor): the only test that
    sees read-only file systems, permissions and full disks alike."""
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir():
        raise InputError(f"{option} {path} cannot be created: {ancestor} is a file, not a directory.")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=staging_prefix(path), suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise InputError(f"{option} {path} cannot be written ({err.strerror} in {ancestor}); choose a writable "
                         "location.") from None


def _nearest_existing(path: Path) -> Path:
    ancestor = Path(path).absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    return ancestor


def check_free_space(path: str | Path, need: float, option: str = "--out") -> None:
    """Refuse before the work an output of about ``need`` bytes that ``path``'s file system has no room for (an
    earlier output there stays until the new one is complete, so it frees nothing)."""
    where = _nearest_existing(Path(path))
    free = shutil.disk_usage(where).free
    if need > free:
        raise InputError(f"{option} {path} needs about {_mb(need)} but {where} has {_mb(free)} free; free some space "
                         "or choose another location.")


def disk_full(err: OSError, path: Path) -> InputError:
    """The one line for a file system that filled up (or a quota reached) while ``path`` was written."""
    where = _nearest_existing(Path(path))
    return InputError(f"the disk filled up while writing {path} ({err.strerror}; {_mb(shutil.disk_usage(where).free)} "
                      f"free in {where}); nothing half-written was kept: free some space and run again.")


def _mb(size: float) -> str:
    return f"{size / 1e6:,.1f} MB"


def temporary_file(parent: Path, prefix: str, suffix: str = "") -> tuple[int, Path]:
    """A new file in ``parent``, open for writing: like :func:`tempfile.mkstemp`, but with the mode a plain
    ``open()`` gives it under the user's umask."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    return _unique(parent, prefix, suffix, lambda path: os.open(path, flags, 0o666))


def temporary_directory(parent: Path, prefix: str) -> Path:
    """A new directory in ``parent``: like :func:`tempfile.mkdtemp`, but with the mode a plain ``mkdir`` gives it
    under the user's umask."""
    return _unique(parent, prefix, "", lambda path: os.mkdir(path, 0o777))[1]


def _unique(parent: Path, prefix: str, suffix: str, create):
    """``(create(path), path)`` for the first unused random name ``prefix…suffix`` in ``parent``."""
    for _ in range(tempfile.TMP_MAX):
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return create(path), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", str(parent))


def staging_prefix(path: Path) -> str:
    """Name prefix of this process's temporaries beside ``path``: hidden, and tagged with the pid that owns them."""
    return f".{Path(path).name}.{STAGING_TAG}-{os.getpid()}-"


def remove_stale_staging(path: Path) -> None:
    """Delete temporaries beside ``path`` whose writing process is gone (a killed or crashed run); an earlier
    output such a run had moved aside (:func:`_swap_in`) is put back first if nothing took its place."""
    parent, head = path.parent, f".{path.name}.{STAGING_TAG}-"
    if not parent.is_dir():
        return
    leftovers = []
    for leftover in parent.iterdir():
        pid = leftover.name[len(head):].split("-", 1)[0] if leftover.name.startswith(head) else ""
        if pid.isdigit() and not _alive(int(pid)):
            leftovers.append(leftover)
    for leftover in leftovers:
        if leftover.name.endswith(f"-{ASIDE}") and not os.path.lexists(path):
            leftover.rename(path)  # killed between _swap_in's renames: the earlier output is whole
        elif leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


@contextmanager
def staged_directory(path: str | Path) -> Iterator[Path]:
    """A fresh directory beside ``path`` to write into; it replaces ``path`` when the block completes and is
    removed if the block fails, so ``path`` is never half-written."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_directory(path.parent, staging_prefix(path))
    with undone_on_failure(path, lambda: shutil.rmtree(staging, ignore_errors=True)):
        yield staging
        _swap_in(staging, path)


@contextmanager
def undone_on_failure(path: Path, undo: Callable[[], None]) -> Iterator[None]:
    """``undo()`` (remove the staging) if the block writing ``path`` fails; a full disk becomes one line."""
    try:
        yield
    except BaseException as err:
        undo()
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            raise disk_full(err, path) from None
        raise


def _swap_in(new: Path, dest: Path) -> None:
    """Rename ``new`` to ``dest``; an earlier ``dest`` is moved aside first and deleted only afterwards. A kill
    between the two renames leaves no ``dest`` but the earlier one whole, aside: the next claim of ``dest`` puts it
    back (:func:`remove_stale_staging`)."""
    if not dest.exists():
        new.rename(dest)
        return
    old = dest.with_name(staging_prefix(dest) + ASIDE)
    dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
