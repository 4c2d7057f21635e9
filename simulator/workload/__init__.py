"""what the network is and what one step does: the model's shape, the workload, the objective."""
