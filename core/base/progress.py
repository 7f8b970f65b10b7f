"""What a long step tells the person waiting for it, on stderr (stdout is for results, which users parse).

A step opens a :func:`task`: with a known total it shows a bar with the time left, without one a status line
with the time spent. On a terminal that is a live display (nested steps stack their lines); when stderr is a
pipe or a CI log, a plain line every :data:`PLAIN_INTERVAL` seconds instead, e.g.
``calibrating: 12/40 windows, 00:31 elapsed, ~01:12 left``. A step shows nothing until it has run
:data:`SHOW_AFTER` seconds, so quick steps leave no flicker behind.

Library calls stay quiet unless asked: ``progress=True`` shows a step, False never, and None (the default
everywhere) follows the process's choice, off unless the CLI turned it on (:func:`shown_by_default`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

SHOW_AFTER = 1.0  # seconds a step runs before it is shown at all
PLAIN_INTERVAL = 5.0  # seconds between plain lines when stderr is not a terminal

T = TypeVar("T")
_by_default = False
_forked = False  # set in a forked worker, which shows nothing
_lock = threading.RLock()
_open: list[Task] = []  # every open step that is to be shown; the innermost last
_display = None  # the shared live display while a step is on a terminal
_ticker: _Ticker | None = None


@contextmanager
def shown_by_default() -> Iterator[None]:
    """Within the block, steps whose caller passed ``progress=None`` are shown (the CLI runs every command so)."""
    global _by_default
    before, _by_default = _by_default, True
    try:
        yield
    finally:
        _by_default = before


def wanted(progress: bool | None) -> bool:
    return not _forked and (_by_default if progress is None else bool(progress))


def _quiet_after_fork() -> None:
    """A forked worker (``build --jobs``) shows nothing: the parent's display is the user's, and its lock may have
    been held by the parent's ticker when the fork happened."""
    global _forked, _lock, _display, _ticker
    _forked, _lock, _display, _ticker = True, threading.RLock(), None, None
    _open.clear()


os.register_at_fork(after_in_child=_quiet_after_fork)


def clock(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Task:
    """One step's progress: ``advance`` counts work done, ``describe`` renames the step as it moves on."""

    def __init__(self, description: str, total: float | None, unit: str):
        self.description, self.total, self.unit = description, total, unit
        self.done, self.started = 0, time.monotonic()
        self.bar_id = None  # its line in the live display, once shown there

    def advance(self, n: float = 1) -> None:
        self.done += n
        self._refresh()

    def describe(self, description: str) -> None:
        self.description = description
        self._refresh()

    def status(self) -> str:
        """``12/40 windows, 00:31 elapsed, ~01:12 left`` (count and time left only when known)."""
        elapsed = time.monotonic() - self.started
        parts = [f"{clock(elapsed)} elapsed"]
        if self.total is not None:
            parts.insert(0, f"{self.done:,.0f}/{self.total:,.0f}" + (f" {self.unit}" if self.unit else ""))
            if 0 < self.done < self.total:
                parts.append(f"~{clock(elapsed / self.done * (self.total - self.done))} left")
        return ", ".join(parts)

    def line(self) -> str:
        return f"{self.description}: {self.status()}"

    def _refresh(self) -> None:
        with _lock:
            if self.bar_id is not None and _display is not None:
                _display.update(self.bar_id, description=self.description, completed=self.done)


class _Quiet(Task):
    """A step nobody sees: counts, and never displays."""

    def _refresh(self) -> None:
        pass


@contextmanager
def task(description: str, total: float | None = None, unit: str = "",
         progress: bool | None = None) -> Iterator[Task]:
    """A step of ``total`` ``unit`` (None: unknown) shown on stderr while the block runs (see the module)."""
    if not wanted(progress):
        yield _Quiet(description, total, unit)
        return
    step = Task(description, total, unit)
    with _lock:
        _open.append(step)
        _start_ticker()
    try:
        yield step
    finally:
        with _lock:
            _open.remove(step)
            if step.bar_id is not None and _display is not None:
                _display.remove_task(step.bar_id)
            ticker = _stop_showing() if not _open else None
        if ticker is not None:
            ticker.join()


def track(items: Iterable[T], description: str, unit: str = "", progress: bool | None = None) -> Iterator[T]:
    """``items`` (listed first, to count them), one at a time, advancing a step whose total is their number."""
    items = list(items)
    with task(description, len(items), unit, progress) as step:
        for item in items:
            yield item
            step.advance()


def note(message: str, progress: bool | None = None) -> None:
    """One line on stderr that stays (above a live display): something the user should know happened."""
    if not wanted(progress):
        return
    with _lock:
        if _display is not None:
            _display.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=_ticker.stream if _ticker is not None else sys.stderr, flush=True)


class _Ticker(threading.Thread):
    """Shows the open steps once they have run :data:`SHOW_AFTER` seconds: in the live display on a terminal,
    else as the innermost step's plain line every :data:`PLAIN_INTERVAL` seconds. It writes to the stderr of
    the moment the first step opened: a toolchain that silences its own chatter by redirecting ``sys.stderr``
    during a step (coremltools' conversion) must not silence the step."""

    def __init__(self):
        from rich.console import Console

        super().__init__(name="npumoe-progress", daemon=True)
        self.stopped = threading.Event()
        self.stream = sys.stderr
        self.console = Console(file=self.stream)
        self.terminal = self.console.is_terminal and not self.console.is_dumb_terminal
        self.last_line = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(min(SHOW_AFTER, PLAIN_INTERVAL) / 5):
            with _lock:
                if self.stopped.is_set():
                    return
                now = time.monotonic()
                if self.terminal:
                    for step in _open:
                        if step.bar_id is None and now - step.started >= SHOW_AFTER:
                            self.show(step)
                elif _open and now - max(self.last_line, _open[-1].started) >= PLAIN_INTERVAL:
                    print(_open[-1].line(), file=self.stream, flush=True)
                    self.last_line = now

    def show(self, step: Task) -> None:
        """``step`` in the live display, which starts with the first step shown."""
        global _display
        if _display is None:
            from rich.progress import BarColumn, Progress, TextColumn

            _display = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.fields[step].status}"), console=self.console, transient=True,
                                redirect_stdout=False, redirect_stderr=False)
            _display.start()
        step.bar_id = _display.add_task(step.description, total=step.total, completed=step.done, step=_Status(step))


class _Status:
    """The live display's text for a step, read at every refresh (rich formats fields with ``str.format``)."""

    def __init__(self, step: Task):
        self.step = step

    @property
    def status(self) -> str:
        return self.step.status()


def _start_ticker() -> None:
    global _ticker
    if _ticker is None:
        _ticker = _Ticker()
        _ticker.start()


def _stop_showing() -> _Ticker | None:
    """Stop the live display and tell the ticker to stop (under the lock); the caller joins it outside."""
    global _ticker, _display
    ticker, _ticker = _ticker, None
    if ticker is not None:
        ticker.stopped.set()
    if _display is not None:
        _display.stop()
        _display = None
    return ticker
