"""What this machine can give a process now: the planners' and kernels' checks before they allocate or measure."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or 0 if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def physical_memory() -> int:
    """Bytes of RAM this machine has, or 0 if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return 0


@dataclass(frozen=True)
class CpuSample:
    """Seconds at one instant: wall clock, the whole machine's busy CPU time (None where /proc/stat is absent) and
    this process's own CPU time."""

    wall: float
    busy: float | None
    own: float


def cpu_sample() -> CpuSample:
    own = os.times()
    return CpuSample(time.perf_counter(), _machine_busy_seconds(), own.user + own.system)


def others_cpu_share(before: CpuSample, after: CpuSample) -> float | None:
    """The share (0-1) of the machine's CPU time between two samples that other processes used, steal included:
    what a timing taken meanwhile competed with. None where the OS does not say."""
    wall = after.wall - before.wall
    if before.busy is None or after.busy is None or wall <= 0:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(max(others / (wall * (os.cpu_count() or 1)), 0.0), 1.0)


def others_cpu_share_now(seconds: float = 0.1) -> float | None:
    """:func:`others_cpu_share` over a short sleep: is the machine busy right now?"""
    before = cpu_sample()
    time.sleep(seconds)
    return others_cpu_share(before, cpu_sample())


def _machine_busy_seconds() -> float | None:
    """All CPUs' non-idle time since boot: /proc/stat's first line less idle and iowait, in seconds."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
