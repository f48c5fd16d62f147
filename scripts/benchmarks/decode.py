"""Decoding throughput: our softmax DecoderLM's `generate` beside transformers' LlamaForCausalLM `generate` of the
same shape (configs/model/tiny.yaml's: 4 layers, d 256, 4 heads, SwiGLU 768; vocab 4096, untied), greedy, batch 1,
after a prompt of 4k and 16k random tokens, the two taking turns. Decode tokens/s is timed by generate's streamer
(evaluation/samples.py TokenClock) from the first new token to the last (the prefill left out). Ours keeps K/V in
storage reserved in blocks (model/layers.py KVBuffer); Llama's DynamicCache concatenates per token."""
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from evaluation.samples import TokenClock
from model import DecoderLM, LMConfig
from scripts.benchmarks.common import ROOT, markdown_table


def decode_tokens_per_sec(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Greedy generate of new_tokens: (new_tokens - 1) / the time from the first new token to the last."""
    clock = TokenClock()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    assert out.shape[1] == prompt.shape[1] + new_tokens and len(clock.times) == new_tokens + 1
    return clock.decode_tokens_per_sec()


def run(quick: bool) -> str:
    m = OmegaConf.load(ROOT / "configs" / "model" / "tiny.yaml")
    contexts, new_tokens, rounds = ((256, 512), 8, 1) if quick else ((4096, 16384), 65, 3)
    shape = dict(vocab_size=4096, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                 num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                 intermediate_size=m.intermediate_size, max_position_embeddings=max(contexts) + new_tokens,
                 tie_word_embeddings=False)
    torch.manual_seed(0)
    models = {"ours": DecoderLM(LMConfig(**shape)).eval(),
              "llama": LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).eval()}
    rows = []
    for context in contexts:
        prompt = torch.randint(0, shape["vocab_size"], (1, context), generator=torch.Generator().manual_seed(context))
        speeds = {name: [] for name in models}
        for _ in range(rounds):  # the two take turns: noise hits both alike
            for name, model in models.items():
                speeds[name].append(decode_tokens_per_sec(model, prompt, new_tokens))
        ours, llama = (sorted(s)[len(s) // 2] for s in speeds.values())
        rows.append([context, f"{ours:.1f}", f"{llama:.1f}", f"{ours / llama:.2f}x"])
    return (f"greedy decode at batch 1, {new_tokens - 1} timed tokens after the first (threads={torch.get_num_threads()})"
            "\n\n" + markdown_table(["context", "ours tokens/s", "transformers Llama tokens/s", "ours / Llama"], rows))
