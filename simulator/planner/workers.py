"""A search's worker processes: forked on first use and kept until the search ends.

Candidates are independent, so a search scales with cores. Fork (not spawn) because workers then
share the already-imported simulator, and whatever the search has cached by then, and start in
milliseconds; one pool for the whole search because the pruned screen asks for a few
simulations at a time, and a pool per request would cost more than they do. Where the OS cannot
fork, or with one worker, everything runs in this process.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from functools import partial

# Fewest items `Workers.map` splits with one process forked for the odd half when a core is idle
# and too few items are asked for a pool: a fork costs ~5 ms here and the child starts ~10 ms
# later, so each half must hold a few event-engine runs (~6-8 ms each) to gain
HALVES_LEAST = 6


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Workers:
    """`map` and `chunks` over `n` forked processes, in order; a context manager."""

    def __init__(self, n: int | None = None) -> None:
        self.n = n or available_cores()
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @property
    def parallel(self) -> bool:
        return self.n > 1 and "fork" in mp.get_all_start_methods()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.n, mp_context=mp.get_context("fork"))
        return self._pool

    def map(self, job, items: list, least: int = 16) -> list:
        """[job(x) for x in items], one item per task (their costs differ by 30x); fewer than
        `least` items per worker run here (a pool's worker is sent the job, model included, with
        every task, and finds again the layouts and prices this process has found: DiffusionGemma
        16 GPUs' 16 re-scorings took 150-160 ms over a pool of 2 against ~110 ms here), or, from
        HALVES_LEAST items while a core is idle, half here and half in a process forked now
        (`halves`)."""
        if not self.parallel or len(items) < least * self.n:
            if self.parallel and self._pool is None and len(items) >= HALVES_LEAST and core_free():
                return halves(job, items)
            return [job(x) for x in items]
        return list(self._executor().map(job, items))

    def chunks(self, job, items: list, least: int = 64) -> list:
        """[job(x) for x in items] in `n` consecutive chunks: neighbours share what a worker
        caches, and a chunk costs one round trip; fewer than `least` items per worker run here
        (measured on 2 cores: 60 bounds in a worker cost about what forking it does)."""
        if not self.parallel or len(items) < least * self.n:
            return [job(x) for x in items]
        size = -(-len(items) // self.n)
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        return [y for part in self._executor().map(partial(_all, job), parts) for y in part]


def _all(job, items: list) -> list:
    return [job(x) for x in items]


def halves(job, items: list) -> list:
    """[job(x) for x in items]: the odd-indexed ones in a process forked for them, the rest here
    at the same time. Forked now, the child holds everything this process has found (layouts,
    graphs, prices), so its items cost what they would here; it runs the same code on the same
    inputs, so the results are the same numbers. If it fails or dies, its items run here."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    gc.freeze()  # the collector then leaves the shared heap's pages alone in the child
    try:
        child = ctx.Process(target=_odd_half, args=(send, job, items[1::2]), daemon=True)
        child.start()
    finally:
        gc.unfreeze()
    send.close()
    done = False
    try:
        mine = [job(x) for x in items[0::2]]
        done = True
        try:
            ok, theirs = receive.recv()
        except (EOFError, OSError):
            ok, theirs = False, None
    finally:
        if not done:  # this side raised: the helper's half is not wanted
            child.terminate()
        child.join()
        receive.close()
    if not ok:
        theirs = [job(x) for x in items[1::2]]
    out: list = [None] * len(items)
    out[0::2], out[1::2] = mine, theirs
    return out


def _odd_half(send, job, items: list) -> None:
    try:
        out = (True, [job(x) for x in items])
    except Exception:  # noqa: BLE001 (the parent runs them itself and raises what it raises)
        out = (False, None)
    send.send(out)
    send.close()


def core_free() -> bool:
    """Whether a core is idle for a second process: fewer runnable tasks than the cores this
    process may use, this one included (Linux: `/proc/loadavg`'s count of tasks runnable now),
    else the last minute's load average at least half a core below them. On a host others keep
    busy two processes would only take turns on the same cores (and pay for the fork). The count
    now, not the minute's average, where the host gives it: the average still carries the last
    search's own load for a minute."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0]) < available_cores()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] < available_cores() - 0.5 if hasattr(os, "getloadavg") else True
