"""Closed-form step time for screening: one pass over the ops in program order, no event queue.

Per rank, compute ops run back to back; a transfer starts when its inputs are ready and, for a
collective, when its last member has arrived; with overlap it runs beside compute (no queueing
behind other transfers) and only the wait of the op that needs its result is exposed. Without
overlap a transfer holds the rank like a compute op. So a rank's time is sum(compute) + exposed
communication, with the slowest member setting each collective, evaluated for all
representative ranks at once.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import Timeline, program
from csbp.simulator.cost.graph import StepGraph


def run(graph: StepGraph, d: np.ndarray, overlap: bool = True, stretch: np.ndarray | None = None) -> Timeline:
    return Timeline(*program.run(graph, d, overlap, queue_comm=False, stretch=stretch))
