"""Graph-stage passes, in the order the pipeline runs them.

1. canonicalize: one spelling per meaning (split+getitem -> slices, transpose ->
   permute) and no identity ops, so every later matcher sees a single form.
2. cse: merge repeated computations first, so a weight cast written twice is folded
   (and stored) once, and later passes see shared values as one node.
3. complex_products: a complex multiply of pairs (Meta's RoPE: view_as_complex times
   a complex64 table) as real arithmetic on the pairs, its table's pairs a constant,
   so no complex value is left to run unfused; before folding, which it feeds.
4. fold_conv_scale: (CPU target) a per-channel scale and shift after a convolution
   (eval BatchNorm) move into its weight and bias, as weight-only compute...
5. fold_constants: ...which, with all weight-only compute, becomes constants while the
   graph still holds the user's own views of them (folding sees through canonical views).
6. propagate_reshapes: move permutes / reshapes down through elementwise ops so
   inverse pairs cancel; it may leave reshape chains behind...
7. collapse_dims: ...which this composes, so no reshape reads a reshape and no
   collapse -> expand -> collapse round trip remains.
8. split_fp8_linear: an fp8 linear over more than a decode step's tokens becomes
   quantise-once + the block-scaled GEMM (two kernels instead of one that requantises
   x per output tile).
9. eager_attention: attention written out (q @ k^T, scale, mask, softmax, @ v) as one
   scaled_dot_product_attention op, on the composed views it matches.
10. tril_rows: mask rows gathered from a constant causal buffer by positions (gpt-fast's
   `causal[None, None, input_pos]`) as `arange(M) <= position`, computed where used
   and recognisable as a prefix of the keys a row...
11. causal_sdpa: ...and an SDPA whose mask its aranges prove `key <= query`
   (transformers' prompt mask without a cache) as is_causal, other masks without their
   always-true terms, after eager_attention made its SDPAs.
12. patterns: label RMSNorm / RoPE / SwiGLU / attention on the final structure (labels
   do not survive rewrites, so they come after every rewriting pass).
13. dce: drop whatever the rewrites left unused (the masks causal_sdpa replaced);
   establishes no-dead-code last so the earlier passes need not clean up after each
   other.
"""

from kiln.graph.canonicalize import canonicalize
from kiln.graph.causal_sdpa import causal_sdpa
from kiln.graph.collapse_dims import collapse_dims
from kiln.graph.complex_products import complex_products
from kiln.graph.cse import cse
from kiln.graph.dce import dce
from kiln.graph.eager_attention import eager_attention
from kiln.graph.fold_constants import fold_constants
from kiln.graph.fold_conv_scale import fold_conv_scale
from kiln.graph.patterns import patterns
from kiln.graph.propagate_reshapes import propagate_reshapes
from kiln.graph.split_fp8_linear import split_fp8_linear
from kiln.graph.tril_rows import tril_rows

GRAPH_PASSES = [canonicalize, cse, complex_products, fold_conv_scale, fold_constants,
                propagate_reshapes, collapse_dims, split_fp8_linear, eager_attention,
                tril_rows, causal_sdpa, patterns, dce]
