"""a parallel plan's degrees and choices, and the rules a plan must keep."""
