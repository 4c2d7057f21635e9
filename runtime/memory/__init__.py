"""memory accounting on CPU ranks as CUDA's caching allocator would see it."""
