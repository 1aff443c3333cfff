"""kiln's own ops: operations models call that torch.export keeps whole.

Each is a torch.library custom op in the `kiln` namespace with a PyTorch
implementation that defines it (and runs it on the CPU target) and a fake
implementation for export. Importing this package registers them.
"""

import kiln.ops.collectives  # noqa: F401
from kiln.ops.fp8_linear import dequantize_weight, fp8_linear, quantize_weight
from kiln.ops.gated_delta_rule import gated_delta_rule
from kiln.ops.latent_attention import latent_attention
from kiln.ops.moe_experts import moe_experts
from kiln.ops.moe_experts_fp8 import moe_experts_fp8, quantize_experts
from kiln.ops.moe_experts_fp8 import scale_shape as expert_scale_shape
from kiln.ops.softcap_attention import softcap_attention

__all__ = ["dequantize_weight", "expert_scale_shape", "fp8_linear", "gated_delta_rule",
           "latent_attention", "moe_experts", "moe_experts_fp8", "quantize_experts",
           "quantize_weight", "softcap_attention"]
