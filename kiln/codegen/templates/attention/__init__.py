"""The flash-attention template for SDPA regions, and causal-mask recognition."""
