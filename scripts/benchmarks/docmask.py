"""The cost of document masking on training throughput, per mixer: fwd + bwd of a small DecoderLM
(2 layers, d=128, vocab 512) on packed blocks with position_ids from realistic document lengths
(log-normal, median 400 tokens, windows of one flat stream, so rows start mid-document) against the
same blocks without position_ids. Ratios of 1-thread process CPU time, the two taking turns."""
import torch

from model import MIXERS, DecoderLM, LMConfig
from scripts.benchmarks.common import cpu_times, markdown_table


def packed_position_ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """position_ids of B windows of T tokens of a stream of documents (each ending in its EOS)
    whose lengths are log-normal with median 400 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < B * T + T:
        lengths.append(max(1, int(torch.empty(1).log_normal_(6.0, 1.0, generator=gen))))
    stream = torch.cat([torch.arange(n) for n in lengths])
    offset = int(torch.randint(0, T, (1,), generator=gen))  # the first window starts mid-document
    return stream[offset:offset + B * T].view(B, T)


def step_fn(model, ids, position_ids):
    def step():
        model(input_ids=ids, labels=ids, position_ids=position_ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def run(quick: bool) -> str:
    B, T = (2, 128) if quick else (4, 512)
    rounds, iters = (2, 1) if quick else (5, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    position_ids = packed_position_ids(B, T)
    segments = int((position_ids == 0).sum() + (position_ids[:, 0] != 0).sum())
    ids = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(0))
    rows = []
    for mixer in MIXERS.names():
        torch.manual_seed(0)
        model = DecoderLM(LMConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=256, max_position_embeddings=T, mixer=mixer))
        steps = {"plain": step_fn(model, ids, None), "masked": step_fn(model, ids, position_ids)}
        times = {name: [] for name in steps}
        for _ in range(rounds):  # interleaved, so that load from other processes hits both alike
            for name, fn in steps.items():
                times[name] += cpu_times(fn, iters)
        plain, masked = (sorted(times[n])[len(times[n]) // 2] for n in ("plain", "masked"))
        rows.append([mixer, f"{B * T / plain:,.0f}", f"{B * T / masked:,.0f}", f"{plain / masked:.2f}"])
    torch.set_num_threads(threads)
    return (f"B={B}, T={T}, {segments} document segments in the batch; tokens/s from the median 1-thread "
            f"process CPU time of fwd+bwd over {rounds}x{iters} interleaved calls (CPU time, so other load "
            f"on the machine perturbs it little)\n\n"
            + markdown_table(["mixer", "tokens/s plain", "tokens/s masked", "masked / plain"], rows))
