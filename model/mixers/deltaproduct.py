"""Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
Products", NeurIPS; the flash-linear-attention GatedDeltaProduct layer): Gated DeltaNet with n = num_householder
delta-rule steps per token, each with its own key, value and beta, the decay applied once per token,

    q = l2norm(silu(conv(W_q x))),  k_j = l2norm(silu(conv(W_k x))_j),  v_j = silu(conv(W_v x))_j,  beta_j = sigmoid(W_b x)_j
    S_t = [prod_{j=n..1} (I - beta_tj k_tj k_tj^T)] Diag(exp g_t) S_{t-1} + (the n writes beta_tj v_tj k_tj^T, in turn)
    g = -exp(A_log) softplus(W_a x + dt_bias),  y = W_o [RMSNorm(o) * silu(W_g x)]

The transition of a token is a product of n generalized Householder matrices (identity plus rank n): n trades
speed (n steps per token) for the groups a layer can track (S_n with n steps and negative eigenvalues, the paper's
theory). allow_neg_eigval: every beta_j in (0, 2), as the rest of the family (fla's layer defaults it on; its
model config, as here, off). use_short_conv, use_forget_gate and use_output_gate (each on by default, as fla's)
off give the paper's state-tracking model: q, k, v = silu(W x), g = 0, y = W_o RMSNorm(o) (its repository's
state_tracking/src/main.py; configs/experiment/state_tracking_deltaproduct.yaml). The block is Gated DeltaNet's
with W_k, W_v, W_b and their convs n times as wide (the n steps' features side by side); the rule runs on
model/ops/gated_delta/product.py, the interleaved sequence of T n steps (fla's layout), on CUDA through fla's gated
delta rule kernels.

Init as fla's GatedDeltaProductPreTrainedModel, which is GDN's (model/mixers/gdn.py): every projection and short conv
N(0, initializer_range), A ~ U(0, 16) stored as log A, softplus(dt_bias) ~ logU(1e-3, 1e-1) floored at 1e-4, with
DeltaRuleBlock's o_proj residual scale.
"""
from dataclasses import dataclass

from model.mixers.gdn import GatedDeltaNet, GDNOptions
from model.ops.gated_delta.product import (chunk_gated_delta_product, fused_recurrent_gated_delta_product,
                                           gated_delta_product_cp)
from model.options import option
from model.registry import MIXERS


@dataclass
class DeltaProductOptions(GDNOptions):
    num_householder: int = option(2, at_least=1)  # n: delta-rule steps (Householder factors) per token
    use_forget_gate: bool = option(True)  # False: no decay, g = 0 (fla's use_forget_gate; the paper's state-tracking model)
    use_output_gate: bool = option(True)  # False: y = W_o RMSNorm(o) (fla's use_output_gate; the same model)


@MIXERS.register("deltaproduct")
class GatedDeltaProduct(GatedDeltaNet):
    Options = DeltaProductOptions

    def __init__(self, config, layer_idx: int = 0):
        opts = config.options_for_mixer("deltaproduct", DeltaProductOptions)
        super().__init__(config, layer_idx, "deltaproduct", opts.num_householder, opts.use_forget_gate,
                         opts.use_output_gate)

    def rule(self, q, k, v, g, beta, write, initial_state=None, output_final_state=False, cu_seqlens=None,
             decoding=False):
        if decoding:
            return fused_recurrent_gated_delta_product(q, k, v, g, beta, self.steps, initial_state=initial_state,
                                                       output_final_state=output_final_state)
        return chunk_gated_delta_product(q, k, v, g, beta, self.steps, initial_state=initial_state,
                                         output_final_state=output_final_state, chunk_size=self.chunk_size,
                                         cu_seqlens=cu_seqlens)

    def rule_cp(self, q, k, v, g, beta, write, segments):
        return gated_delta_product_cp(q, k, v, g, beta, self.steps, segments, chunk_size=self.chunk_size)
