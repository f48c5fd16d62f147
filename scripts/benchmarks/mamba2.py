"""Mamba2 speed beside transformers' Mamba2 torch path (mamba_ssm is not installed here, so
transformers runs its reference PyTorch code; the op peer is called through `__wrapped__`, its torch
function, to be sure).

Op: fwd+bwd of model.ops.ssd.mamba_chunk_scan vs transformers' `mamba2_chunk_scan` on the same
inputs (B 8 x T 256, H 8, P 64, N 64, G 1, chunk 64, dt_softplus + dt_bias, D), outputs checked to
agree. GFLOP/s counts the same nominal SSD FLOPs for both (3x forward, full chunk blocks).

Model: fwd+bwd+AdamW tokens/s, batch 8 x 256, vocab 512, d 256, 4 layers, state 64, 8 heads of 64:
  - ours, mamba2-only: Embedding, 4 x [x + Mamba2(RMSNorm(x))], RMSNorm, tied head: transformers'
    Mamba2ForCausalLM architecture from our blocks, loaded with its weights (logits checked to agree);
  - transformers Mamba2ForCausalLM (torch path), the peer;
  - ours, DecoderLM mixer=mamba2, as the project builds it (adds a SwiGLU FFN per layer: ~2x the
    FLOPs, so its tokens/s is not comparable; its GFLOP/s is).
Timings are interleaved rounds, median; GFLOP/s against the fp32 matmul peak of the same run.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2

from model import DecoderLM, LMConfig
from model.layers import RMSNorm
from model.mixers.mamba2 import Mamba2
from model.ops.linear_attention import chunk_flops_per_token
from model.ops.ssd import mamba_chunk_scan
from scripts.benchmarks.common import interleaved, markdown_table, matmul_peak_gflops

VOCAB, D, LAYERS, HEADS, HEAD_DIM, STATE, CHUNK = 512, 256, 4, 8, 64, 64, 64


def op_report(Bsz: int, T: int, rounds: int, iters: int, peak: float) -> str:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = dict(x=r(Bsz, T, HEADS, HEAD_DIM), dt=r(Bsz, T, HEADS) - 2, A=-torch.rand(HEADS, generator=g) * 15 - 1,
                  B=r(Bsz, T, 1, STATE), C=r(Bsz, T, 1, STATE), D=torch.ones(HEADS), dt_bias=r(HEADS) * 0.1)
    x, dt, A, B, C, D, dt_bias = (v.requires_grad_() for v in inputs.values())
    hf_scan = getattr(hf_mamba2.mamba2_chunk_scan, "__wrapped__", hf_mamba2.mamba2_chunk_scan)
    fns = {
        "ours mamba_chunk_scan": lambda: mamba_chunk_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True),
        "transformers mamba2_chunk_scan": lambda: hf_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True),
    }
    with torch.no_grad():
        outs = [fn() for fn in fns.values()]
    err = (outs[0] - outs[1]).abs().max().item()
    timed = interleaved({k: (lambda fn=fn: fn().sum().backward()) for k, fn in fns.items()}, rounds, iters)
    flops = 3 * chunk_flops_per_token(T, CHUNK, 1, HEADS, STATE, HEAD_DIM) * Bsz * T
    peer = timed["transformers mamba2_chunk_scan"]
    rows = [[name, f"{t * 1e3:.1f}", f"{flops / t / 1e9:.1f}", f"{peer / t:.2f}x"] for name, t in timed.items()]
    return (f"Op, fwd+bwd, B {Bsz} x T {T}, H {HEADS}, P {HEAD_DIM}, N {STATE}, chunk {CHUNK} "
            f"(max |y_ours - y_transformers| = {err:.1e}):\n\n"
            + markdown_table(["op", "ms", "GFLOP/s", "speed vs transformers"], rows)
            + f"\n\nGFLOP/s share of the matmul peak ({peak:.0f}): "
            + ", ".join(f"{name} {flops / t / 1e9 / peak:.1%}" for name, t in timed.items()))


class Mamba2Stack(nn.Module):
    """transformers' Mamba2ForCausalLM architecture from our blocks (no FFN)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norms = nn.ModuleList(RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(config.num_hidden_layers))
        self.mixers = nn.ModuleList(Mamba2(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return F.linear(self.norm_f(x), self.embed.weight)

    def flops_per_token(self, T: int) -> float:
        return sum(m.flops_per_token(T, "cpu") for m in self.mixers) + 2 * self.embed.weight.numel()

    @torch.no_grad()
    def load_from(self, hf: Mamba2ForCausalLM) -> None:
        self.embed.weight.copy_(hf.backbone.embeddings.weight)
        self.norm_f.weight.copy_(hf.backbone.norm_f.weight)
        for norm, ours, block in zip(self.norms, self.mixers, hf.backbone.layers):
            theirs = block.mixer
            norm.weight.copy_(block.norm.weight)
            for a, b in [(ours.in_proj.weight, theirs.in_proj.weight), (ours.conv.conv.weight, theirs.conv1d.weight),
                         (ours.conv.conv.bias, theirs.conv1d.bias), (ours.dt_bias, theirs.dt_bias),
                         (ours.A_log, theirs.A_log), (ours.D, theirs.D), (ours.norm.weight, theirs.norm.weight),
                         (ours.out_proj.weight, theirs.out_proj.weight)]:
                a.copy_(b)


def model_report(Bsz: int, T: int, rounds: int, iters: int, peak: float) -> str:
    torch.manual_seed(0)
    options = {"mamba2": dict(expand=2, head_dim=HEAD_DIM, state_size=STATE, n_groups=1, conv_size=4, chunk_size=CHUNK)}
    config = LMConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, mixer="mamba2",
                      mixer_options=options, max_position_embeddings=max(2048, T))
    hf_config = Mamba2Config(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_heads=HEADS,
                             head_dim=HEAD_DIM, expand=2, state_size=STATE, n_groups=1, conv_kernel=4,
                             chunk_size=CHUNK, layer_norm_epsilon=config.rms_norm_eps, tie_word_embeddings=True)
    hf = Mamba2ForCausalLM(hf_config)
    stack = Mamba2Stack(config)
    stack.load_from(hf)
    lm = DecoderLM(config)
    ids = torch.randint(0, VOCAB, (Bsz, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (stack(ids) - hf.eval()(ids).logits).abs().max().item()

    def train_step(model, loss_fn):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = loss_fn(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    def stack_loss(m):
        return F.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    models = {
        "ours, mamba2-only (transformers' architecture)": (stack, stack_loss, stack.flops_per_token(T)),
        "transformers Mamba2ForCausalLM (torch path)": (hf, lambda m: m(ids, labels=ids).loss, stack.flops_per_token(T)),
        "ours, DecoderLM mixer=mamba2 (+ SwiGLU)": (lm, lambda m: m(ids, labels=ids).loss, lm.flops_per_token(T, "cpu")),
    }
    timed = interleaved({k: train_step(m, loss) for k, (m, loss, _) in models.items()}, rounds, iters)
    peer = timed["transformers Mamba2ForCausalLM (torch path)"]
    rows = []
    for name, (m, _, fpt) in models.items():
        t = timed[name]
        gflops = 3 * fpt * Bsz * T / t / 1e9
        rows.append([name, f"{sum(p.numel() for p in m.parameters()) / 1e6:.2f}M", f"{Bsz * T / t:,.0f}",
                     f"{peer / t:.2f}x", f"{fpt / 1e6:.2f}", f"{gflops:.1f}", f"{gflops / peak:.1%}"])
    return (f"Model, fwd+bwd+AdamW, batch {Bsz} x {T}, vocab {VOCAB}, d {D}, {LAYERS} layers, state {STATE}, "
            f"{HEADS} heads of {HEAD_DIM}, chunk {CHUNK} (max |logits_ours - logits_transformers| with "
            f"shared weights = {err:.1e}):\n\n"
            + markdown_table(["model", "params", "tokens/s", "speed vs transformers", "fwd MFLOP/token",
                              "GFLOP/s", "of peak"], rows))


def run(quick: bool) -> str:
    Bsz, T = (2, 128) if quick else (8, 256)
    rounds, iters = (2, 2) if quick else (5, 3)
    peak = matmul_peak_gflops()
    return "\n\n".join([
        f"torch threads {torch.get_num_threads()}; fp32 matmul peak {peak:.0f} GFLOP/s (same run).",
        op_report(Bsz, T, rounds, iters, peak),
        model_report(Bsz, T, rounds, iters, peak),
    ])
