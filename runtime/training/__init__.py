"""the training loop and its entry points (csbp run, torchrun), checkpoints, faults."""
