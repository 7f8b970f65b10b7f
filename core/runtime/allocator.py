"""The C allocator tuned for a runtime whose eager ops free and reallocate tens of MB a layer.

glibc serves blocks above its mmap threshold (128 KB, rising with use to at most 32 MB) from fresh mappings,
which it unmaps on free, and gives back free heap above its trim threshold: so a prompt's activations, expert
buffers and kernel scratch were mapped, page-faulted in and unmapped again layer after layer. Serving blocks up
to 32 MB (glibc's ceiling for the threshold on 64-bit) from the heap and keeping up to 256 MB of freed heap makes a
bf16 prefill faster, the most on AVX2 (docs/performance.md, "Allocator"), at the price of the process keeping that
much freed memory for reuse instead of returning it. (The trim threshold alone is far worse: setting it turns
glibc's adaptive mmap threshold off.)
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own variables: left to the user


@functools.cache
def keep_freed_blocks() -> bool:
    """Tune glibc's malloc as above, once a process; False (nothing changed) off glibc Linux or where the user set
    glibc's own variables for these thresholds."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
