"""Kernel templates: one per region kind (select_kernels.TEMPLATES), one per extern op kiln
writes a kernel for (EXTERN_TEMPLATES: gated_delta, latent_attention), plus split_k."""
