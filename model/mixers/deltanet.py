"""DeltaNet (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length";
the flash-linear-attention DeltaNet layer at its defaults): the delta rule with no decay,

    q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x))),  v = silu(conv(W_v x)),  beta = sigmoid(W_b x)
    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,  o_t = S_t q_t / sqrt(d_k)
    y = W_o RMSNorm(o)   (per head; fla's use_gate=False)

allow_neg_eigval: beta in (0, 2) (Grazzi et al. 2025; model/mixers/delta_rule.py). The block (short convs, q/k norm,
beta, decoding through the conv tails and the state h [B, H, d_k, d_v]) is DeltaRuleBlock's; the rule runs on
model/ops/gated_delta with g = None (on CUDA: fla's chunk_gated_delta_rule with g = 0, as fla's chunk_delta_rule
takes no float32, and fused_recurrent_delta_rule to decode).

Init as fla's DeltaNetPreTrainedModel (every projection N(0, initializer_range), the norm's weight 1), with
DeltaRuleBlock's short-conv kernels N(0, initializer_range) as fla's and its one deliberate difference, o_proj's
residual scale (model/mixers/delta_rule.py).
"""
from model.layers import RMSNorm
from model.mixers.delta_rule import DeltaRuleBlock, DeltaRuleOptions
from model.registry import MIXERS


@MIXERS.register("deltanet")
class DeltaNet(DeltaRuleBlock):
    Options = DeltaRuleOptions

    def __init__(self, config, layer_idx: int = 0):
        super().__init__(config, layer_idx, "deltanet", config.options_for_mixer("deltanet", DeltaRuleOptions))
        self.o_norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)

    def init_parameters(self) -> None:
        self.init_projections(self.q_proj, self.k_proj, self.v_proj, self.b_proj)
        self.init_convs_and_output()

    def decay(self, x):
        return None

    def normalize(self, o, x):
        return self.o_norm(o)
