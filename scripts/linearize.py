"""Seed study: how well does softmax attention linearized into a gated delta rule (derived GDN,
model/ops/gated_delta.py derived_gated_delta_rule) approximate softmax attention?

(a) Approximation table (always): relative error ||o - o_softmax|| / ||o_softmax|| against exact causal
    softmax attention softmax(s q.k / sqrt(d)) v on the same q, k, v, as the logit scale s grows, for
    random keys and structured ones (clustered, drifting), of
      - VaLA, the plain first-order expansion: o_t = vbar_t + ((1/t) sum_i v_i k_i^T - vbar_t kbar_t^T) q_t,
      - derived GDN, its recursion exactly, and with clamp_ktil (the derived_gdn mixer's default).
    q and k carry (s / sqrt(d))^1/2 each in both linearizations. Writes a markdown table and a PNG.

(b) Zero-shot linearization (--checkpoint DIR, a trained softmax DecoderLM): validation loss / perplexity
    of the checkpoint as is, then with every layer (or --layers 0,2) swapped to derived_gdn (clamped and
    exact), to VaLA (same projections, quadratic-time reference core defined here) and to the `linear`
    mixer (elu+1 normalised linear attention over the same projections); then --finetune-steps AdamW steps
    at --lr on the derived_gdn model and its loss after. Token blocks come from the checkpoint's own
    training data (load_blocks).

    python scripts/linearize.py                              # part (a) only, outputs/linearize/
    python scripts/linearize.py --checkpoint outputs/<softmax run> --layers 0,2 --finetune-steps 300
"""
import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from data.types import Split
from model import DecoderLM
from model.mixers.softmax import SoftmaxAttention
from model.ops.gated_delta import derived_gated_delta_rule
from model.ops.kernels import repeat_heads
from training.evaluation import evaluate_split

ROOT = Path(__file__).resolve().parents[1]

SCALES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
METHODS = ["VaLA", "derived GDN (exact)", "derived GDN (clamp_ktil)"]


# (a) approximation error --------------------------------------------------------------------------
def softmax_attention(q, k, v, scale):
    """Causal softmax(scale q.k) v, q, k, v [B, T, H, d]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


def vala_attention(q, k, v, scale):
    """o_t = vbar_t + ((1/t) sum_{i<=t} v_i k_i^T - vbar_t kbar_t^T) q_t, q and k times scale^1/2
    (quadratic-time form: (1/t) sum_i v_i (k_i . q_t) through a causal mask)."""
    q, k = q * scale ** 0.5, k * scale ** 0.5
    T = q.shape[1]
    t = torch.arange(1, T + 1, dtype=q.dtype, device=q.device)[None, :, None, None]
    kbar, vbar = k.cumsum(1) / t, v.cumsum(1) / t
    qk = torch.einsum("bthd,bshd->bhts", q, k).tril()
    mean_vk_q = torch.einsum("bhts,bshd->bthd", qk, v) / t
    return vbar + mean_vk_q - vbar * (kbar * q).sum(-1, keepdim=True)


def approximations(q, k, v, scale) -> dict:
    return {
        "VaLA": vala_attention(q, k, v, scale),
        "derived GDN (exact)": derived_gated_delta_rule(q, k, v, scale=scale)[0],
        "derived GDN (clamp_ktil)": derived_gated_delta_rule(q, k, v, scale=scale, clamp_ktil=True)[0],
    }


def make_qkv(kind: str, B=4, T=512, H=4, d=64, seed=0):
    """Unit-variance q, k, v [B, T, H, d]. random: iid; clustered: q and k near one of 8 shared
    centroids; drifting: q and k near a mean direction that rotates once over the sequence."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    v = r(B, T, H, d)
    if kind == "random":
        return r(B, T, H, d), r(B, T, H, d), v
    if kind == "clustered":
        centroids = r(B, 1, H, 8, d)
        pick = lambda: torch.randint(0, 8, (B, T, H, 1, 1), generator=g).expand(B, T, H, 1, d)  # noqa: E731
        near = lambda: (centroids.expand(B, T, H, 8, d).gather(3, pick())[:, :, :, 0] + 0.3 * r(B, T, H, d)) / 1.044  # noqa: E731
        return near(), near(), v
    if kind == "drifting":
        a, b = r(B, 1, H, d), r(B, 1, H, d)
        theta = torch.linspace(0, 2 * math.pi, T, dtype=torch.float64)[None, :, None, None]
        mean = a * theta.cos() + b * theta.sin()
        near = lambda: (mean + 0.5 * r(B, T, H, d)) / 1.118  # noqa: E731
        return near(), near(), v
    raise ValueError(f"unknown key kind {kind!r}; valid: random, clustered, drifting")


def approximation_table(out: Path) -> str:
    kinds = ["random", "clustered", "drifting"]
    errors = {kind: {m: [] for m in METHODS} for kind in kinds}
    rows = []
    for kind in kinds:
        q, k, v = make_qkv(kind)
        d = q.shape[-1]
        for s in SCALES:
            scale = s / math.sqrt(d)
            ref = softmax_attention(q, k, v, scale)
            row = [kind, s]
            for name, o in approximations(q, k, v, scale).items():
                err = ((o - ref).norm() / ref.norm()).item()
                errors[kind][name].append(err)
                row.append(f"{err:.3g}")
            rows.append(row)
    lines = ["| keys | logit scale s | " + " | ".join(METHODS) + " |", "|---" * (2 + len(METHODS)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    table = "\n".join(lines)
    plot(errors, out / "approximation_error.png")
    (out / "approximation_error.md").write_text(table + "\n")
    return table


def plot(errors: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(errors), figsize=(4.5 * len(errors), 3.6), sharey=True)
    for ax, (kind, per_method) in zip(axes, errors.items()):
        for name, errs in per_method.items():
            ax.plot(SCALES, [min(e, 1e3) for e in errs], marker="o", label=name)
        ax.set(xscale="log", yscale="log", title=f"{kind} keys", xlabel="logit scale s (logits s q.k / sqrt(d))")
        ax.set_xticks(SCALES, [f"{s:g}" for s in SCALES], minor=False)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("||o - o_softmax|| / ||o_softmax|| (capped at 1e3)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# (b) zero-shot linearization ----------------------------------------------------------------------
class VaLAAttention(SoftmaxAttention):
    """Softmax attention's projections with the VaLA core (quadratic-time, evaluation only; not a
    registered mixer: `with_vala` puts it into a loaded model)."""

    def core(self, q, k, v, cache, aux, segments=None):
        if cache is not None or segments is not None:
            raise ValueError("vala is an evaluation-only reference core; it keeps no decoding cache and "
                             "takes no document masking (position_ids)")
        k, v = repeat_heads(k, self.num_heads), repeat_heads(v, self.num_heads)
        return vala_attention(q.float(), k.float(), v.float(), self.head_dim ** -0.5).to(v.dtype)


def load_blocks(checkpoint_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) token blocks [N, L] of the data the checkpoint was trained on, rebuilt from its
    training_config.yaml through the data pipeline (cached, deterministic) with its own tokenizer."""
    from omegaconf import OmegaConf

    from data import build_data
    from training.checkpoint import weights_dir

    folder = weights_dir(checkpoint_dir)
    cfg = OmegaConf.load(folder / "training_config.yaml")
    data_cfg = OmegaConf.merge(cfg.data, {"tokenizer": str(folder)}) if cfg.data.get("tokenizer") == "bpe" else cfg.data
    data = build_data(data_cfg, cfg.trainer.seq_len, cfg.seed)
    return tuple(split.batch(torch.arange(len(split)))["input_ids"] for split in (data.train, data.val))


def evaluate(model: DecoderLM, blocks: torch.Tensor, batch_size: int) -> float:
    """Token-weighted mean loss over the blocks (no document masking: VaLA takes none)."""
    sums = evaluate_split(model, Split(blocks), batch_size, None, torch.device("cpu"), None)
    return (sums["loss_sum"] / sums["count"]).item()


def swapped(checkpoint: Path, mixer: str, layers: list[int] | None, **mixer_options) -> DecoderLM:
    original = DecoderLM.from_pretrained(checkpoint).config.layer_mixers
    chosen = range(len(original)) if layers is None else layers
    schedule = [mixer if i in chosen else name for i, name in enumerate(original)]
    model, info = DecoderLM.from_pretrained(checkpoint, mixer=schedule, output_loading_info=True,
                                            mixer_options={mixer: mixer_options})
    if info["missing_keys"] or info["unexpected_keys"]:
        raise ValueError(f"{mixer}: checkpoint does not load cleanly: {info}")
    return model


def with_vala(checkpoint: Path, layers: list[int] | None) -> DecoderLM:
    """The checkpoint with the chosen layers' (default all) mixers replaced by VaLA cores over the same
    projections, their weights moved over (strict: a softmax layer's parameters exactly)."""
    model = DecoderLM.from_pretrained(checkpoint)
    for i in range(len(model.layers)) if layers is None else layers:
        block = model.layers[i]
        vala = VaLAAttention(model.config, i)
        vala.load_state_dict(block.mixer.state_dict())
        block.mixer = vala
    return model


def finetune(model: DecoderLM, blocks: torch.Tensor, steps: int, lr: float, batch_size: int) -> None:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = blocks[torch.randint(0, len(blocks), (batch_size,), generator=g)]
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def linearization_table(args) -> str:
    from training.checkpoint import weights_dir

    checkpoint = weights_dir(args.checkpoint)
    train, val = load_blocks(checkpoint)
    val = val[: args.max_blocks]
    layers = None if args.layers is None else [int(i) for i in args.layers.split(",")]
    which = "all layers" if layers is None else f"layers {layers}"
    rows = [["softmax (checkpoint)", evaluate(DecoderLM.from_pretrained(checkpoint), val, args.batch_size)]]
    variants = [("derived_gdn (clamp_ktil)", lambda: swapped(checkpoint, "derived_gdn", layers, clamp_ktil=True)),
                ("derived_gdn (exact)", lambda: swapped(checkpoint, "derived_gdn", layers, clamp_ktil=False)),
                ("VaLA (same projections)", lambda: with_vala(checkpoint, layers)),
                ("linear (elu+1, normalised)", lambda: swapped(checkpoint, "linear", layers))]
    for name, build in variants:
        rows.append([f"{name}, {which}", evaluate(build(), val, args.batch_size)])
    if args.finetune_steps:
        model = swapped(checkpoint, "derived_gdn", layers, clamp_ktil=True)
        finetune(model, train, args.finetune_steps, args.lr, args.batch_size)
        rows.append([f"derived_gdn (clamp_ktil), {which}, after {args.finetune_steps} AdamW steps at lr {args.lr}",
                     evaluate(model, val, args.batch_size)])
    lines = ["| model | val loss | val ppl |", "|---|---|---|"]
    lines += [f"| {name} | {loss:.4f} | {math.exp(min(loss, 50)):.2f} |" for name, loss in rows]
    return f"Zero-shot linearization of {checkpoint} on {tuple(val.shape)} val tokens:\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "linearize"))
    parser.add_argument("--checkpoint", help="a softmax run dir or its final/ HF dir (part b)")
    parser.add_argument("--layers", help="comma-separated layer indices to swap (default: all)")
    parser.add_argument("--max-blocks", type=int, default=256, help="validation blocks evaluated")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = "## Approximation error vs exact causal softmax attention\n\n" + approximation_table(out)
    if args.checkpoint:
        report += "\n\n## Zero-shot linearization\n\n" + linearization_table(args)
    (out / "report.md").write_text(report + "\n")
    print(report)
    print(f"\nwrote {out / 'report.md'} and {out / 'approximation_error.png'}")


if __name__ == "__main__":
    main()
