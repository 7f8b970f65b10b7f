"""bench export's memory measure: a process's anonymous memory counts what it allocates, not a file it maps and reads
(how npumoe-run's mapped program is told from weights copied into its own memory)."""

import subprocess
import sys
import time

import pytest

from npumoe.bench.export import anonymous_bytes

SIZE = 64 << 20
CHILD = """
import mmap, sys, time
kind, path = sys.argv[1], sys.argv[2]
if kind == "allocates":
    held = bytearray(b"x" * {size})
elif kind == "maps":
    with open(path, "rb") as f:
        held = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    sum(held[i] for i in range(0, len(held), 4096))  # every page read in
print("ready", flush=True)
time.sleep(60)
""".format(size=SIZE)


def measured(kind: str, path) -> int:
    child = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        return anonymous_bytes(child.pid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/smaps_rollup")
def test_anonymous_memory_counts_allocations_not_mapped_files(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\1" * SIZE)
    base, mapped, allocated = (measured(kind, weights) for kind in ("idle", "maps", "allocates"))
    assert allocated - base >= 0.9 * SIZE
    assert mapped - base < 0.1 * SIZE


def test_a_process_that_has_gone_has_no_figure():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    time.sleep(0.05)
    assert anonymous_bytes(child.pid) is None
