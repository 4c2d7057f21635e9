"""No cycle collection while a search runs.

A search allocates millions of short-lived tuples, arrays and ops that reference counting frees
at once, and makes almost no reference cycles (a DiffusionGemma 256K search at 128 GPUs: 764
objects found in cycles in all). CPython's cycle collector still scans the young objects every
700 allocations and, every hundred of those, everything the process keeps (modules, layouts,
prices, graphs). Timed with `gc.callbacks` in one `csbp.plan`: DiffusionGemma at 128 GPUs 1.24 s
of 9.6 s in collections (1.01 s in 10 full ones), Nemotron-8B at 16 GPUs 0.10 s of 0.89 s.
Collection is paused for the search and restored as it was after it. What the search leaves
alive (its caches: layouts, prices, graphs kept for the next search) is then moved out of the
collector's sight (`gc.freeze`): the first young-generation pass after the search would
otherwise scan all of it (0.30 s after that DiffusionGemma search), and it lives as long as the
process. The few cycles among it are never collected [U: a handful of objects per search].
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
