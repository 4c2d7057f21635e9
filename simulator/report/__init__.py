"""a simulation's result, its tables and its traces."""
