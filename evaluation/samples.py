"""A sample from a model through transformers' generate, with its decode speed: what train.py prints at
the end of a run and eval.py writes into eval.json."""
import time

import torch


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, device, *, temperature: float, top_p: float,
           repetition_penalty: float) -> dict:
    """A sample through transformers' generate, seeded (torch's global generator) so that the text
    is reproducible: temperature 0 is greedy, else nucleus sampling (top_p; no top-k cut); a
    repetition_penalty > 1 divides the positive logits (multiplies the negative) of every token
    already in the text (CTRL, arXiv:1909.05858), which keeps small models out of loops. Also
    returns decode tokens/s (new tokens over wall time after the prompt's prefill)."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    settings = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty, **settings,
                         pad_token_id=tokenizer.eos_token_id, eos_token_id=None)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    return {"text": tokenizer.decode(out[0], skip_special_tokens=False), "new_tokens": new,
            "decode_tokens_per_sec": new / seconds}
