"""The cost of document masking on training throughput, per mixer: fwd + bwd of a small DecoderLM
(2 layers, d=128, vocab 512) on packed blocks with position_ids from realistic document lengths
(log-normal, median 400 tokens, windows of one flat stream, so rows start mid-document) against the
same blocks without position_ids; and the cost of padding: the same documents as a padded batch (a row
each, left-padded to the longest, attention_mask), against the packed blocks, tokens/s counting real tokens.
Ratios of 1-thread process CPU time, the three taking turns."""
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


def padded_documents(ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The document segments of the packed rows, a row each, left-padded to the longest: (ids, attention_mask)."""
    documents = []
    for row, positions in zip(ids, position_ids):
        starts = [0] + (positions == 0).nonzero()[:, 0].tolist()
        documents += [row[a:b] for a, b in zip(starts, starts[1:] + [len(row)]) if b > a]
    longest = max(len(d) for d in documents)
    batch, mask = torch.zeros(len(documents), longest, dtype=torch.long), torch.zeros(len(documents), longest, dtype=torch.long)
    for i, d in enumerate(documents):
        batch[i, longest - len(d):], mask[i, longest - len(d):] = d, 1
    return batch, mask


def step_fn(model, ids, position_ids=None, attention_mask=None):
    def step():
        model(input_ids=ids, labels=ids, position_ids=position_ids, attention_mask=attention_mask).loss.backward()
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
    padded, mask = padded_documents(ids, position_ids)
    rows = []
    for mixer in MIXERS.names():
        torch.manual_seed(0)
        model = DecoderLM(LMConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=256, max_position_embeddings=T, mixer=mixer))
        steps = {"plain": step_fn(model, ids), "masked": step_fn(model, ids, position_ids),
                 "padded": step_fn(model, padded, attention_mask=mask)}
        times = {name: [] for name in steps}
        for _ in range(rounds):  # interleaved, so that load from other processes hits all alike
            for name, fn in steps.items():
                times[name] += cpu_times(fn, iters)
        plain, masked, pads = (sorted(times[n])[len(times[n]) // 2] for n in ("plain", "masked", "padded"))
        rows.append([mixer, f"{B * T / plain:,.0f}", f"{B * T / masked:,.0f}", f"{plain / masked:.2f}",
                     f"{B * T / pads:,.0f}", f"{masked / pads:.2f}"])
    torch.set_num_threads(threads)
    return (f"B={B}, T={T}, {segments} document segments in the batch; padded: those {padded.shape[0]} documents, "
            f"a row each, left-padded to {padded.shape[1]} ({mask.float().mean():.0%} real tokens); tokens/s (real "
            f"tokens) from the median 1-thread process CPU time of fwd+bwd over {rounds}x{iters} interleaved calls "
            f"(CPU time, so other load on the machine perturbs it little)\n\n"
            + markdown_table(["mixer", "tokens/s plain", "tokens/s masked", "masked / plain", "tokens/s padded",
                              "padded / masked"], rows))
