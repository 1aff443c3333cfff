"""Kernel templates: one per region kind (select_kernels.TEMPLATES), plus split_k."""
