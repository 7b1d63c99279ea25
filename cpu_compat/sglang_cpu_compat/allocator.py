"""glibc malloc keeps what a forward frees, so the next forward reuses it instead of faulting it in again.

A CPU forward allocates and frees activations of tens to hundreds of MiB per layer. glibc serves blocks above its
mmap threshold (dynamic, at most 32 MiB) with fresh mappings and returns them on free, and trims its heaps' tops back
to the kernel: the next forward page-faults every one of those pages in again, zero-filled by the kernel. How much of
that a process does depends on the history of its threshold, so two servers of the same code can differ by seconds
per long prefill. Measured here (the `small` preset, a cold 8,192-token prefill, stock and Tail-Replay servers side
by side, docs/perf.md): 0.07-1.08 M minor faults and 0.2-8.4 s of system time per prefill under glibc's defaults
(TTFT 4.7-11.6 s), 5-80 faults and 0.1 s after the first prefill with this policy (TTFT 4.47-4.54 s, both servers).

The policy is what preloading tcmalloc (the usual advice for PyTorch on CPU) does for a server: freed memory stays
with the process, whose resident size stays at its peak. Set TAILREPLAY_CPU_GLIBC_MALLOC=default to keep glibc's own.
"""

import ctypes
import ctypes.util
import logging

from sglang_cpu_compat.env import keep_glibc_malloc_defaults

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before glibc returns any
TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trimming in this process (True if applied)."""
    if keep_glibc_malloc_defaults():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    applied = all(mallopt(param, value) == 1
                  for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, TOP_PAD)))
    if applied:
        logger.info("sglang_cpu_compat: glibc malloc keeps freed memory (no mmap for large blocks, no trimming)")
    return applied
