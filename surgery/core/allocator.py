"""Freed memory handed back to the system while surgery's own work runs (glibc's ``malloc_trim``).

glibc keeps freed memory for reuse: after a verb has made and dropped its temporaries (a
block's activations, fake-quantized copies, GPTQ's Hessians), the process stays as large as it
was at its peak although nothing holds that memory. The command line can fix the allocator for
its own process (``MALLOC_MMAP_THRESHOLD_``); a library cannot change a script's allocator for
good, so surgery trims instead: at the end of every verb and after every offloaded block, the
free pages go back, and nothing of the caller's allocator settings changes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library is another."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed_memory() -> bool:
    """Return the pages of every freed allocation to the system (all arenas); False where the C
    library is not glibc (nothing done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
