"""Our mixer against transformers' implementation of the same block on the same MQAR data, side by side.

    python scripts/mqar_side_by_side.py --block mamba2 --hidden-size 128 --steps 500 --lr 1e-2

Both models are 2 layers of the block (ours: DecoderLM with mixer=<block>, dense FFN and the
block's defaults at head_dim 32; theirs: transformers' Mamba2ForCausalLM, mixer-only layers, the same
heads, head_dim, state size and expand), trained on the same batches of experiment=mqar's data
(configs/data/mqar.yaml, trainer.seq_len 64, batch 64) with the same AdamW (betas 0.9, 0.95,
weight decay 0.1), linear warm-up of 50 steps then cosine to 0.1 lr, gradient clipping at 1.
Prints the query accuracy per slice on the test set for both, at the end. One thread.
"""
import argparse
import math
import sys
import time
from pathlib import Path

import torch

from data.mqar import build_mqar
from model import DecoderLM, LMConfig

ROOT = Path(__file__).resolve().parents[1]

BLOCKS = ("mamba2", "gdn", "derived_gdn", "softmax", "linear", "dsa")   # ours; transformers' beside mamba2 only


def transformers_mamba2(vocab: int, d: int, head_dim: int, state: int):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=vocab, hidden_size=d, num_hidden_layers=2, expand=2, head_dim=head_dim,
                          num_heads=2 * d // head_dim, state_size=state, n_groups=1, chunk_size=64,
                          tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return Mamba2ForCausalLM(config)


def train(model, data, steps: int, lr: float, batch_size: int, seed: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                                 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    g = torch.Generator().manual_seed(seed)
    start = time.process_time()
    model.train()
    for _ in range(steps):
        batch = data.train.batch(torch.randint(0, len(data.train), (batch_size,), generator=g))
        ids, labels = batch["input_ids"], batch["labels"]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    return time.process_time() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", default="mamba2", help=f"one of {', '.join(BLOCKS)}")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--state-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embed-std", type=float, help="re-draw our embedding from N(0, std) (transformers' Mamba2: 0.1)")
    p.add_argument("--untied", action="store_true", help="our lm_head its own matrix, N(0, 0.02), not the embedding")
    p.add_argument("--ours-only", action="store_true", help="skip transformers' Mamba2")
    args = p.parse_args(argv)
    if args.block not in BLOCKS:
        sys.exit(f"error: unknown --block {args.block!r}; valid: {', '.join(BLOCKS)}")
    torch.set_num_threads(1)
    from omegaconf import OmegaConf

    data_cfg = OmegaConf.load(ROOT / "configs" / "data" / "mqar.yaml")
    data = build_mqar(data_cfg, seq_len=64, seed=args.seed)
    d = args.hidden_size
    torch.manual_seed(args.seed)
    ours = DecoderLM(LMConfig(vocab_size=data.vocab_size, hidden_size=d, num_hidden_layers=2, num_attention_heads=2,
                              max_position_embeddings=64, mixer=args.block, tie_word_embeddings=not args.untied,
                              mixer_options={"mamba2": {"head_dim": args.head_dim, "state_size": args.state_size}}))
    if args.embed_std is not None:
        torch.nn.init.normal_(ours.embed_tokens.weight, std=args.embed_std)
    models = [("ours", ours)]
    if args.block == "mamba2" and not args.ours_only:
        torch.manual_seed(args.seed)
        models.insert(0, ("transformers", transformers_mamba2(data.vocab_size, d, args.head_dim, args.state_size)))
    for name, model in models:
        seconds = train(model, data, args.steps, args.lr, 64, args.seed)
        acc = data.extra_eval(model, torch.device("cpu"))
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params, {seconds:.0f} CPU s, "
              + ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in acc.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
