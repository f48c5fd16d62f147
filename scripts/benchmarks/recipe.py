"""The default recipe against the plain loop a user would write, at equal wall clock, same corpus.

1. ours: `python train.py` (the default config; a fresh token cache, so tokenizer training and
   tokenization count, as on a first run), timed end to end: that wall time is W.
2. the peer: the simplest transformers loop (PEER below: byte-level BPE 4,096 trained on the same
   stdlib train split, `LlamaForCausalLM` 4 x 256, random 16 x 256 windows of the concatenated
   train tokens, AdamW 3e-3 with a cosine over the wall-clock budget, nothing else), in its own
   process, training until its whole run (tokenizer included) has taken W.
3. both final models scored here by the same code on the same bytes: every document of the stdlib
   val split, as EOS + its tokens in windows of 256 (each window sees only its own document's
   earlier tokens in that window); bits per byte = total nats over the documents' tokens / ln 2 /
   their UTF-8 bytes, which does not depend on the tokenizer.
Then (unless --quick) the gdn, mamba2 and moe variants of the default (`mixer=gdn`, ...), each
with the default's step budget, scored the same way beside their own wall time.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from scripts.benchmarks.common import markdown_table

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "outputs" / "bench" / "recipe"
SEQ_LEN = 256
VARIANTS = {"gdn": ["mixer=gdn"], "mamba2": ["mixer=mamba2"], "moe": ["ffn=moe"]}

PEER = textwrap.dedent('''
    import json, math, sys, time
    t_start = time.time()
    import torch
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from data.text import stdlib_documents  # the same train split as train.py's data=stdlib (cwd: the repo)
    budget, out = float(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)

    train_docs, _, _ = stdlib_documents(OmegaConf.create({"max_documents": None, "val_fraction": 0.05}))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(train_docs, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    data = torch.tensor([t for ids in tok(train_docs)["input_ids"] for t in ids + [tok.eos_token_id]])
    setup_seconds = time.time() - t_start

    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, max_position_embeddings=256))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_seconds = budget - setup_seconds
    t0, step = time.time(), 0
    while (elapsed := time.time() - t0) < train_seconds:
        for group in opt.param_groups:  # cosine to 0 over the time budget
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * elapsed / train_seconds))
        i = torch.randint(len(data) - 256, (16,))
        x = torch.stack([data[j:j + 256] for j in i])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(json.dumps({"steps": step, "tokens": step * 16 * 256, "train_seconds": time.time() - t0,
                      "setup_seconds": setup_seconds, "wall_seconds": time.time() - t_start}))
''')


def val_documents() -> list[str]:
    from omegaconf import OmegaConf

    from data.text import stdlib_documents

    return stdlib_documents(OmegaConf.create({"max_documents": None, "val_fraction": 0.05}))[1]


@torch.no_grad()
def bits_per_byte(model, tokenizer, documents: list[str]) -> float:
    """Total nats of every document's tokens (each document as EOS + its tokens, cut into windows
    of SEQ_LEN predicted tokens, each window starting at position 0) / ln 2 / the documents' UTF-8
    bytes."""
    model.eval()
    eos = tokenizer.eos_token_id
    windows = []
    for ids in tokenizer([d for d in documents if d], add_special_tokens=False)["input_ids"]:
        ids = [eos] + ids
        windows += [ids[i:i + SEQ_LEN + 1] for i in range(0, len(ids) - 1, SEQ_LEN)]
    windows.sort(key=len)
    nats = 0.0
    for start in range(0, len(windows), 16):  # batches of equal-length windows where possible
        chunk = windows[start:start + 16]
        for length in sorted({len(w) for w in chunk}):
            x = torch.tensor([w for w in chunk if len(w) == length])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nats += torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    return nats / math.log(2) / sum(len(d.encode("utf-8")) for d in documents)


def train_ours(name: str, overrides: list[str], cache: Path) -> dict:
    """`python train.py` + overrides in a fresh process; its wall time, steps and tokens/s."""
    run_dir = WORK / name
    env = {**os.environ, "SWAPLM_CACHE": str(cache)}
    t0 = time.time()
    subprocess.run([sys.executable, str(ROOT / "train.py"), f"run_dir={run_dir}", *overrides], cwd=ROOT, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["perf/tokens_per_sec"] for r in rows if "perf/tokens_per_sec" in r]
    return {"wall": wall, "tokens": rows[-1]["tokens_seen"], "tokens_per_sec": sum(speeds) / len(speeds),
            "in_run_bpb": rows[-1].get("val/bpb"), "folder": run_dir / "final"}


def train_peer(budget: float) -> dict:
    folder = WORK / "peer"
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", PEER, str(budget), str(folder)], cwd=ROOT,
                          check=True, capture_output=True, text=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(wall=time.time() - t0, tokens_per_sec=out["tokens"] / out["train_seconds"], folder=folder)
    return out


def score(folder: Path, documents: list[str]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import model  # noqa: F401  (registers our model with the Auto classes)

    return bits_per_byte(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), documents)


def run(quick: bool) -> str:
    WORK.mkdir(parents=True, exist_ok=True)
    documents = val_documents()
    extra = ["trainer.max_steps=20"] if quick else []
    with tempfile.TemporaryDirectory() as cache:
        ours = train_ours("ours", extra, Path(cache))
        peer = train_peer(ours["wall"])
        variants = {} if quick else {k: train_ours(k, v, Path(cache)) for k, v in VARIANTS.items()}
    torch.set_num_threads(os.cpu_count())
    for r in (ours, peer, *variants.values()):
        r["bpb"] = score(r["folder"], documents)
    nbytes = sum(len(d.encode("utf-8")) for d in documents)
    rows = [["peer: transformers Llama loop, AdamW", f"{peer['wall']:.0f} s ({peer['setup_seconds']:.0f} s setup)",
             f"{peer['tokens']:,}", f"{peer['tokens_per_sec']:,.0f}", f"{peer['bpb']:.4f}", "1.00"],
            ["ours: `python train.py`", f"{ours['wall']:.0f} s", f"{ours['tokens']:,}",
             f"{ours['tokens_per_sec']:,.0f}", f"{ours['bpb']:.4f}", f"{ours['bpb'] / peer['bpb']:.3f}"]]
    rows += [[f"ours: `python train.py {' '.join(VARIANTS[k])}`", f"{r['wall']:.0f} s", f"{r['tokens']:,}",
              f"{r['tokens_per_sec']:,.0f}", f"{r['bpb']:.4f}", f"{r['bpb'] / peer['bpb']:.3f}"]
             for k, r in variants.items()]
    return (f"W = {ours['wall']:.0f} s (our default run's wall time, first run: fresh token cache); val = the stdlib "
            f"val split, {len(documents)} documents, {nbytes:,} UTF-8 bytes; torch threads {torch.get_num_threads()}; "
            f"in-run val bpb of ours (its first eval_batches, mean bytes per token): {ours['in_run_bpb']:.4f}\n\n"
            + markdown_table(["run", "wall time", "train tokens", "train tokens/s", "val bpb", "bpb / peer"], rows))
