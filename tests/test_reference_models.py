"""Ours against the reference implementations the studies train beside it (studies/mqar.py, studies/gdn_language.py):
with the reference's weights loaded into ours, the two compute the same logits, so a gap between them in a study
is their starts' (init, parametrization), never their forwards'; and the lr schedule both train under
(studies/side_by_side.py)."""
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

# Runs in a fresh process: the Qwen3-Next reference blocks fla's import for its process (studies/side_by_side.py reference).
QWEN3_NEXT_GDN = r'''
import torch
from studies.side_by_side import Shape, ours, reference

torch.manual_seed(0)
shape = Shape(layers=2, heads=2, seq_len=80, intermediate_size=96)
ref = reference("qwen3_next_gdn", 64, 32, shape).double()
mine = ours("gdn", 64, 32, "fla", shape).double()
for p in ref.parameters():  # away from the init (norm offsets at 0, dt_bias at 1): every weight must be mapped right
    p.data.add_(0.1 * torch.randn_like(p))
g = mine.layers[0].mixer
H, Hv, K, V = g.num_heads, g.num_v_heads, g.head_dim, g.head_v_dim
r = Hv // H
state = {"embed_tokens.weight": ref.model.embed_tokens.weight, "norm.weight": 1 + ref.model.norm.weight,
         "lm_head.weight": ref.lm_head.weight}
for i, layer in enumerate(ref.model.layers):
    a = layer.linear_attn
    # in_proj_qkvz: per key head [q (K) | k (K) | v (r V) | z (r V)]; in_proj_ba: per key head [b (r) | a (r)]
    q, k, v, z = a.in_proj_qkvz.weight.view(H, 2 * K + 2 * r * V, -1).split([K, K, r * V, r * V], dim=1)
    b, a_ = a.in_proj_ba.weight.view(H, 2 * r, -1).split([r, r], dim=1)
    conv_q, conv_k, conv_v = a.conv1d.weight.split([H * K, H * K, Hv * V])
    for name, w in {"q_proj": q, "k_proj": k, "v_proj": v, "g_proj": z, "b_proj": b, "a_proj": a_,
                    "q_conv.conv": conv_q, "k_conv.conv": conv_k, "v_conv.conv": conv_v, "o_norm": a.norm.weight,
                    "o_proj": a.out_proj.weight}.items():
        state[f"layers.{i}.mixer.{name}.weight"] = w.reshape(-1, *w.shape[2:]) if w.dim() == 3 and "conv" not in name else w
    state[f"layers.{i}.mixer.A_log"], state[f"layers.{i}.mixer.dt_bias"] = a.A_log, a.dt_bias
    state[f"layers.{i}.mixer_norm.weight"] = 1 + layer.input_layernorm.weight  # Qwen3-Next's norms: x (1 + w)
    state[f"layers.{i}.ffn_norm.weight"] = 1 + layer.post_attention_layernorm.weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        state[f"layers.{i}.ffn.{name}.weight"] = getattr(layer.mlp, name).weight
mine.load_state_dict({k: w.detach().clone() for k, w in state.items()}, strict=True)
ids = torch.randint(0, 64, (2, 80))  # 80: not a multiple of either chunk (ours 32, the reference's 64)
with torch.no_grad():
    theirs, ours_ = ref(input_ids=ids).logits, mine(input_ids=ids).logits
print("max_abs_diff", (theirs - ours_).abs().max().item(), "scale", theirs.abs().max().item())
'''


def test_gdn_computes_qwen3_next_gdn_with_its_weights():
    """Our gdn LM (untied, as Qwen3-Next) with a Qwen3-Next GDN model's weights (perturbed off its init) gives its
    logits, over a length that is not a multiple of either chunk size: in float64, but for the reference's delta-rule
    op, which computes in float32 whatever its input (transformers' torch_chunk_gated_delta_rule), so to 1e-5 of the
    logits' scale where a weight mapped wrong moves them by their own size."""
    out = subprocess.run([sys.executable, "-c", QWEN3_NEXT_GDN], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    diff, scale = float(words[words.index("max_abs_diff") + 1]), float(words[words.index("scale") + 1])
    assert scale > 1 and diff < 1e-5 * scale, out.stdout


def test_side_by_side_schedule():
    """The studies' lr factor: (s + 1) / warmup over the warm-up, then transformers' cosine to 0.1 step for step
    (get_cosine_with_min_lr_schedule_with_warmup, whose warm-up starts at 0 instead), 0.1 at the last step."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from studies.side_by_side import warmup_cosine

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(opt, 10, 50, min_lr_rate=0.1).lr_lambdas[0]
    assert [warmup_cosine(s, 10, 50) for s in (0, 9)] == [0.1, 1.0]
    assert all(warmup_cosine(s, 10, 50) == pytest.approx(theirs(s)) for s in range(10, 51))
    assert warmup_cosine(50, 10, 50) == pytest.approx(0.1)
