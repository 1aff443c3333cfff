"""Row kernels for reduction regions: the kernel, its forms, per-op accumulators."""
