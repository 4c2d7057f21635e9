"""one rank of a large plan on one device, collectives replaced by local buffers."""
