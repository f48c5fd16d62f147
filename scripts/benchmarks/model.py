"""Whole-model training throughput: our softmax + dense DecoderLM beside transformers'
LlamaForCausalLM of the same shape (4 layers, d=256, 4 heads, SwiGLU 768, vocab 512, untied),
fwd + bwd + AdamW step at batch 8 x 256, interleaved in one run; and ours with the default
optimizer=muon step, whose Newton-Schulz iterations add work that no model change removes."""
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from model import DecoderLM, LMConfig
from scripts.benchmarks.common import ROOT, interleaved, markdown_table, matmul_peak_gflops
from training.optim import build_optimizer


def train_step_fn(model, batch, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(quick: bool) -> str:
    B, T = (4, 128) if quick else (8, 256)
    shape = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=768, max_position_embeddings=T, tie_word_embeddings=False)
    torch.manual_seed(0)
    ours = DecoderLM(LMConfig(**shape))
    ours_muon = DecoderLM(LMConfig(**shape))
    muon = build_optimizer(ours_muon, OmegaConf.load(ROOT / "configs" / "optimizer" / "muon.yaml"), lr=1e-4)
    llama = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    batch = torch.randint(0, 512, (B, T))
    steps = {"ours (softmax, dense)": train_step_fn(ours, batch), "transformers Llama (sdpa)": train_step_fn(llama, batch),
             "ours (softmax, dense), optimizer=muon": train_step_fn(ours_muon, batch, muon)}
    times = interleaved(steps, rounds=3, iters=3 if quick else 10)  # peers take turns: noise hits both alike
    peak = matmul_peak_gflops()
    flops = 3 * ours.flops_per_token(T, "cpu") * B * T
    base = times["transformers Llama (sdpa)"]
    rows = []
    for name, t in times.items():
        rows.append([name, f"{B * T / t:,.0f}", f"{t * 1e3:.0f}", f"{flops / t / 1e9:.0f}", f"{base / t:.2f}x"])
    params = sum(p.numel() for p in ours.parameters())
    return (f"B={B}, T={T}, {params / 1e6:.2f}M params, fp32 matmul peak {peak:.0f} GFLOP/s "
            f"(threads={torch.get_num_threads()})\n\n"
            + markdown_table(["model", "tokens/s", "ms/step", "GFLOP/s", "vs Llama"], rows))
