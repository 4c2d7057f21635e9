"""CPU ranks keep the memory they free, as CUDA's caching allocator does on a GPU.

glibc's malloc serves large blocks (the score matrices of explicit attention, 16-64 MiB here)
with a fresh mmap each time and gives them back on free, so every step faults their pages in
again: 4 KiB at a time, each fault zeroing its page (about 1.3 us per page measured on the CI
host; a 1024 x 1024 x 4-head fp32 score matrix is 4096 faults). How many allocations fault
depends on glibc's adaptive thresholds, so step times wandered by 10-20 % and the DP plan at
L = 1024 spent a third of its step faulting. With mmap off and trimming off, freed blocks stay
in the heap and are reused: steps are faster and repeatable, and the microbenchmarks of
`csbp calibrate` run in the same regime. The cost is the allocator's fragmentation, which the
peak resident set (`rss_peak_gib` of a run; `peak_memory_gib` is the allocated-bytes peak of
`memory_tracker`) includes; `start_peak` gives the kept memory back between jobs so each job's
peaks are its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
TRIM_ABOVE = 2**31 - 1  # bytes of free heap top before glibc gives any back: the int maximum


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):  # no C library found
        return None


def keep_freed_memory() -> bool:
    """Serve every block from the heap and never shrink it; False where malloc is not glibc's."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # no C library found, or no mallopt (macOS)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))


def start_peak() -> None:
    """Give the heap's free memory back to the system and restart the peak resident set
    (VmHWM) and the allocated-bytes tracker (`memory_tracker`), so the peaks a job reports are
    its own, not an earlier job's in the same process."""
    from csbp.runtime.memory import memory_tracker

    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # Linux >= 4.0: reset the peak RSS to the current RSS
    except OSError:
        pass
    memory_tracker.start()


def proc_bytes(path: str, key: str) -> int | None:
    """A `key: N kB` line of a /proc file in bytes, None where there is no such file or line."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_high_water() -> int | None:
    """This process's peak resident set in bytes (VmHWM), None without /proc. Not ru_maxrss:
    Linux carries that over from the parent through fork + exec, so a spawned rank would report
    its launcher's peak when that is larger."""
    return proc_bytes("/proc/self/status", "VmHWM")
