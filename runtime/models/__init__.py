"""the block-diffusion model (also trained plain autoregressive), its attention kernels and its
objectives, for real."""
