"""the one source of truth: which positions, blocks and K/V rows each rank holds and moves."""
