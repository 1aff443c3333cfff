"""The gated delta rule's kernels (kiln::gated_delta_rule): see template.py."""
