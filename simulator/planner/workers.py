"""A search's worker processes: forked on first use and kept until the search ends.

Candidates are independent, so a search scales with cores. Fork (not spawn) because workers then
share the already-imported simulator, and whatever the search has cached by then, and start in
milliseconds; one pool for the whole search because the pruned screen asks for a few
simulations at a time, and a pool per request would cost more than they do. Where the OS cannot
fork, or with one worker, everything runs in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from functools import partial


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

    def map(self, job, items: list, least: int = 8) -> list:
        """[job(x) for x in items], one item per task (their costs differ by 30x); fewer than
        `least` items per worker run here (a worker costs its fork and the layouts and prices
        it finds again, which this process has already found)."""
        if not self.parallel or len(items) < least * self.n:
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
