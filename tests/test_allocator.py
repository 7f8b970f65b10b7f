"""npumoe.core.runtime.allocator: glibc's thresholds raised once a process, never over the user's own settings."""

import platform
import sys

from npumoe.core.runtime import allocator


def test_glibc_keeps_freed_blocks_unless_the_user_set_its_thresholds(monkeypatch):
    monkeypatch.setattr(allocator, "keep_freed_blocks", allocator.keep_freed_blocks.__wrapped__)  # uncached
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_freed_blocks() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert allocator.keep_freed_blocks() is glibc  # mallopt accepted both values
