"""torch.distributed: the counted comm layer, the mesh, one module per parallelism."""
