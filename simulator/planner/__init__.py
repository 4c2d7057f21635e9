"""searching the plan space: bounds, screening, re-scoring, the plan file."""
