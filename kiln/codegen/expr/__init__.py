"""Turning ops into Triton expressions: values, index maps, views, the emitter, per-op rules."""
