"""The recall suite's probes (evaluation/suites/recall.py runs them): a passkey hidden at a chosen depth of a
context of val text and asked for at the end, scored by greedy exact match, the answer's log-probability, a
forced choice of the key among candidates and the key's log-probability lift over the same context without
the needle; a copy score (the loss on the second occurrence of a repeated span minus the first); and MQAR
accuracy for a model trained on MQAR."""
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from data.types import Split
from evaluation.context import first_line, positions_up_to, too_long

NEEDLE_KEY = 'passkey = "'  # the needle is NEEDLE_KEY + key + '"', the query NEEDLE_KEY
KEY_DIGITS = 5


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def passkey_example(filler: torch.Tensor, tokenizer, context: int, depth: float,
                    key: str) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(input_ids, answer_ids, needle) of one passkey trial of `context` tokens in all (prompt + answer):
    F = context - |needle| - |query| - |answer| filler tokens (filler[:F]) with the needle
    "\\npasskey = \\"<key>\\"\\n" inserted at token p = round(depth F), then the query "\\npasskey = \\"".
    needle is the needle's slice of input_ids, p to p + |needle|; the answer (the key's tokens, as in the
    needle) starts at p + |"\\n"| + |'passkey = "'|. Each piece is tokenized on its own, so the answer's tokens
    in the needle are exactly answer_ids."""
    newline, lead = encode(tokenizer, "\n"), encode(tokenizer, NEEDLE_KEY)
    answer = encode(tokenizer, key)
    needle = torch.cat([newline, lead, answer, encode(tokenizer, '"\n')])
    query = torch.cat([newline, lead])
    size = context - len(needle) - len(query) - len(answer)
    if size < 0 or len(filler) < size:
        raise ValueError(f"passkey context {context} with {len(filler)} filler tokens: needs "
                         f"{len(needle) + len(query) + len(answer)} + filler tokens")
    p = round(depth * size)
    return torch.cat([filler[:p], needle, filler[p:size], query]), answer, slice(p, p + len(needle))


def without_needle(input_ids: torch.Tensor, needle: slice) -> torch.Tensor:
    """The same haystack and query with the needle's tokens taken out (the filler joined where it sat)."""
    return torch.cat([input_ids[:needle.start], input_ids[needle.stop:]])


def passkey_trials(stream: torch.Tensor, context: int, trials: int, candidates: int,
                   seed: int) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(key, window, distractors) of each trial i at a context, drawn from (seed, context, i): the key (KEY_DIGITS
    random digits), its window of `context` tokens of the val stream, then candidates - 1 distractors (draw_keys)."""
    out = []
    for i in range(trials):
        rng = np.random.default_rng([seed, context, i])
        key = "".join(map(str, rng.integers(0, 10, KEY_DIGITS)))
        offset = int(rng.integers(0, len(stream) - context + 1))
        out.append((key, stream[offset:offset + context], draw_keys(rng, candidates - 1, key)))
    return out


def draw_keys(rng: np.random.Generator, count: int, exclude: str) -> list[str]:
    """`count` distinct keys of KEY_DIGITS random digits, none equal to `exclude`: the forced choice's
    distractors, drawn as the true key is, so that to a model blind to the needle every candidate is alike."""
    keys: list[str] = []
    while len(keys) < count:
        key = "".join(map(str, rng.integers(0, 10, KEY_DIGITS)))
        if key != exclude and key not in keys:
            keys.append(key)
    return keys


@torch.no_grad()
def score_continuations(lm, input_ids: torch.Tensor, continuations: list[torch.Tensor],
                        device) -> tuple[list[torch.Tensor], list[bool]]:
    """For each continuation of the prompt input_ids: the log-prob of each of its tokens given the prompt
    and its tokens before it, and whether every token is the argmax there (what greedy decoding produces).
    One forward of the prompt that builds the decode cache, the cache repeated into a row per continuation,
    and one forward of the continuations side by side (right-padded: a causal model's scores of a token do
    not see the padding after it)."""
    first = lm(input_ids=input_ids[None].to(device), use_cache=True, logits_to_keep=1)
    cache, n, width = first.past_key_values, len(continuations), max(len(c) for c in continuations)
    logits = first.logits.float().expand(n, 1, -1)
    if width > 1:
        rows = torch.zeros(n, width - 1, dtype=torch.long)
        for i, c in enumerate(continuations):
            rows[i, :len(c) - 1] = c[:-1]
        cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=device))
        logits = torch.cat([logits, lm(input_ids=rows.to(device), past_key_values=cache).logits.float()], 1)
    logprobs = logits.log_softmax(-1)
    out, greedy = [], []
    for i, c in enumerate(continuations):
        c = c.to(device)
        out.append(logprobs[i, :len(c)].gather(-1, c[:, None])[:, 0].cpu())
        greedy.append(bool((logits[i, :len(c)].argmax(-1) == c).all()))
    return out, greedy


def first_place_share(scores: list[float]) -> float:
    """The forced choice's credit for one trial, scores[0] being the true key's: 1 / m when it ties m
    candidates (itself included) at the highest score, 0 when one scores higher (a random pick among the
    tied, in expectation; so a model that scores every candidate alike gets 1 / len(scores) exactly)."""
    top = max(scores)
    return 1.0 / scores.count(top) if scores[0] == top else 0.0


def copy_example(window: torch.Tensor, span: int) -> tuple[torch.Tensor, slice, slice]:
    """(input_ids, first, second) of one copy trial of C = len(window) tokens: the span s = window[:span] and
    the filler f = window[span:C - span], laid out f[:C/2 - span] s f[C/2 - span:] s, so that s occurs at
    C/2 - span and at C - span (C/2 tokens apart), each time after at least C/2 - span filler tokens and
    neither time after the text that preceded it in the val stream. first and second are the slices of the
    target positions scored (a target position t is token t predicted from tokens 0..t-1): each occurrence's
    tokens but its first, which nothing announces."""
    C = len(window)
    s, fill, lead = window[:span], window[span:C - span], C // 2 - span
    ids = torch.cat([fill[:lead], s, fill[lead:], s])
    return ids, slice(lead + 1, lead + span), slice(C - span + 1, C)


@torch.no_grad()
def copy_losses(lm, windows: torch.Tensor, span: int, device) -> tuple[float, float]:
    """The mean loss (nats/token) on the first and on the second occurrence of the span in the copy trials
    (copy_example) of the val windows [N, C], in one forward."""
    examples = [copy_example(w, span) for w in windows]
    ids = torch.stack([ids for ids, _, _ in examples]).to(device)
    loss = F.cross_entropy(lm(input_ids=ids).logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    first, second = examples[0][1], examples[0][2]  # target position t is loss[:, t - 1]
    return (loss[:, first.start - 1:first.stop - 1].mean().item(), loss[:, second.start - 1:second.stop - 1].mean().item())


def filler_stream(split: Split, tokens: int, eos: int | None) -> torch.Tensor:
    """At least `tokens` tokens of val text (the split's first blocks, EOS dropped: a model trained with
    document masking never saw one mid-context), repeated if the split is shorter."""
    per_block = split.batch(torch.arange(1))["input_ids"].shape[1]
    blocks = min(len(split), math.ceil(tokens / per_block) + 1)
    stream = split.batch(torch.arange(blocks))["input_ids"].flatten()
    stream = stream[stream != eos] if eos is not None else stream
    return stream.repeat(math.ceil(tokens / len(stream))) if len(stream) < tokens else stream


def passkey_recall(lm, tokenizer, val: Split, contexts: list[int], depths: list[float], trials: int,
                   candidates: int, copy_span: int, seed: int, device) -> dict:
    """Passkey retrieval (passkey_example) over contexts x depths, each cell the mean over `trials`:
    acc = share of exact greedy answers, answer_logprob = mean log-prob per answer token, choice_acc = the
    forced choice among the key and candidates - 1 distractors by the log-prob of each whole key
    (first_place_share), lift = log p(key | prompt) - log p(key | the prompt without the needle) in nats
    per key; per context, copy = copy_second_loss - copy_first_loss (copy_losses on the trials' windows).
    The trials of a context (passkey_trials) are the same at every depth; trial i's copy trial is its window."""
    grids = ("acc", "answer_logprob", "choice_acc", "lift")
    report = {"contexts": [], "depths": list(depths), **{k: [] for k in grids}, "copy": [], "copy_first_loss": [],
              "copy_second_loss": [], "trials": trials, "candidates": candidates, "copy_span": copy_span, "skipped": {}}
    stream = filler_stream(val, max(contexts), tokenizer.eos_token_id)
    for context in contexts:
        if reason := too_long(lm, context):
            report["skipped"][str(context)] = reason
            print(f"recall {context}: skipped, {reason}")
            continue
        start = time.perf_counter()
        keys, windows, distractors = zip(*passkey_trials(stream, context, trials, candidates, seed))
        distractors = [[encode(tokenizer, k) for k in others] for others in distractors]
        cells = {k: [] for k in grids}
        with positions_up_to(lm, context):
            absent = []  # log p(key | no needle): one haystack at every depth
            for window, key in zip(windows, keys):
                ids, answer, needle = passkey_example(window, tokenizer, context, 0.0, key)
                absent.append(score_continuations(lm, without_needle(ids, needle), [answer], device)[0][0].sum().item())
            for depth in depths:
                trial = {k: [] for k in grids}
                for window, key, others, key_absent in zip(windows, keys, distractors, absent):
                    ids, answer, _ = passkey_example(window, tokenizer, context, depth, key)
                    logprobs, greedy = score_continuations(lm, ids, [answer, *others], device)
                    totals = [lp.sum().item() for lp in logprobs]
                    for k, v in zip(grids, (greedy[0], logprobs[0].mean().item(), first_place_share(totals),
                                            totals[0] - key_absent)):
                        trial[k].append(v)
                for k in grids:
                    cells[k].append(float(np.mean(trial[k])))
            first, second = copy_losses(lm, torch.stack(windows), copy_span, device)
        report["contexts"].append(context)
        for k in grids:
            report[k].append(cells[k])
        report["copy_first_loss"].append(first)
        report["copy_second_loss"].append(second)
        report["copy"].append(second - first)
        print(f"recall {context}: acc {np.mean(cells['acc']):.3f}, choice acc {np.mean(cells['choice_acc']):.3f} "
              f"(chance {1 / candidates:.2f}), lift {np.mean(cells['lift']):.2f} nats, copy {second - first:+.3f} nats/token, "
              f"answer log-prob {np.mean(cells['answer_logprob']):.3f} [{time.perf_counter() - start:.1f}s]")
    return report


def mqar_recall(lm, data_cfg, seq_lens: list[int], num_kv_pairs: list[int], examples: int, seed: int, device) -> dict:
    """MQAR accuracy on query labels (data/mqar.py's generator and query_accuracy) for each seq_len x
    num_kv_pairs: `examples` fresh examples per cell, seeded by (seed, 2, seq_len, n) (2: neither the
    train nor the test split's stream). A cell the protocol cannot hold (seq_len < 4 n, n >= V/2) or a
    seq_len the model cannot take (too_long) is null, with the reason in skipped."""
    from data.mqar import mqar_slice, query_accuracy

    acc, skipped = [], {}
    for seq_len in seq_lens:
        row, start, bound = [], time.perf_counter(), too_long(lm, seq_len)
        for n in num_kv_pairs:
            reason = bound
            if reason is None:
                rng = np.random.Generator(np.random.PCG64([seed, 2, seq_len, n]))
                try:
                    ids, labels = mqar_slice(examples, seq_len, n, data_cfg.vocab_size, data_cfg.power_a, rng)
                except ValueError as e:
                    reason = first_line(e)
            if reason is not None:
                skipped[f"T{seq_len}_kv{n}"] = reason
                row.append(None)
                continue
            with positions_up_to(lm, seq_len):
                split = Split(torch.from_numpy(ids), torch.from_numpy(labels))
                row.append(query_accuracy(lm, split, [("cell", slice(0, examples))], device)["val/mqar_acc/cell"])
        acc.append(row)
        print(f"recall mqar seq_len {seq_len}: acc {row} [{time.perf_counter() - start:.1f}s]")
    return {"mqar": {"seq_lens": list(seq_lens), "num_kv_pairs": list(num_kv_pairs), "acc": acc,
                     "examples": examples, "skipped": skipped}}
