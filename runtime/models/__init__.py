"""the block-diffusion model, its attention kernels and its objective, for real."""
