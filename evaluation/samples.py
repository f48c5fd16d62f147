"""A sample from a model through transformers' generate, with its decode speed: what train.py prints at
the end of a run and eval.py writes into eval.json."""
import time

import torch


class TokenClock:
    """A generate streamer that notes when each put arrives (the prompt's, then one per new token): decode speed
    timed from the first new token to the last, the prompt's prefill left out."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_tokens_per_sec(self) -> float:
        """New tokens after the first over the time since the first; with one new token, that token over the whole
        call (there is no decode phase to time apart)."""
        new = len(self.times) - 1
        if new < 2:
            return new / (self.times[-1] - self.times[0])
        return (new - 1) / (self.times[-1] - self.times[1])


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, device, *, temperature: float, top_p: float,
           repetition_penalty: float) -> dict:
    """A sample through transformers' generate, seeded (torch's global generator) so that the text
    is reproducible: temperature 0 is greedy, else nucleus sampling (top_p; no top-k cut); a
    repetition_penalty > 1 divides the positive logits (multiplies the negative) of every token
    already in the text (CTRL, arXiv:1909.05858), which keeps small models out of loops. Also
    returns decode tokens/s (TokenClock: after the prompt's prefill)."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    settings = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    torch.manual_seed(seed)
    clock = TokenClock()
    out = model.generate(ids, max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty, **settings,
                         pad_token_id=tokenizer.eos_token_id, eos_token_id=None, streamer=clock)
    return {"text": tokenizer.decode(out[0], skip_special_tokens=False), "new_tokens": out.shape[1] - ids.shape[1],
            "decode_tokens_per_sec": clock.decode_tokens_per_sec()}
