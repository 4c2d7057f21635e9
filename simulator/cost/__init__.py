"""the step graph (ops per representative rank), op durations and per-rank memory."""
