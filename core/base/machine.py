"""What this machine can give a process now: the planners' and kernels' checks before they allocate."""

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
