"""Keep freed host memory in the process, as CUDA's caching allocator keeps device memory.

glibc serves large allocations (above a dynamic threshold of 128 KiB to 32 MiB) with fresh
``mmap`` pages and returns the top of the heap to the OS past a trim threshold. The torch
reference attention materialises a ``heads x chunk x context`` fp32 score matrix per row and
layer (4 MiB for a 512-token chunk of the tiny model), so on a CPU device every large prefill
then page-faults its temporaries back in: on this project's CPU machine that was half of a
512-token chunk's time, in system time that depends on what earlier steps freed (measured in
docs/calibration.md, "CPU validation"). A GPU executor pays nothing like it: torch's CUDA
allocator caches freed blocks. ``keep_freed_host_memory`` makes glibc do the same: no ``mmap``
for allocations and no trimming, so freed memory is reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc <malloc.h>)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_NEVER = 2**31 - 1  # mallopt takes an int: the largest trim threshold it accepts

_done: bool | None = None


def keep_freed_host_memory() -> bool:
    """Turn off glibc's mmap allocations and heap trimming for this process (idempotent).
    Returns False, with a warning, where the C library has no ``mallopt`` (not glibc)."""
    global _done
    if _done is not None:
        return _done
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        mallopt = None
    ok = (mallopt is not None and mallopt(M_MMAP_MAX, 0) == 1
          and mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1)
    if not ok:
        log.warning("executor.keep_host_memory: the C library (%s) has no glibc mallopt; host "
                    "allocations keep their default behaviour (large steps may page-fault)",
                    name)
    _done = ok
    return ok
