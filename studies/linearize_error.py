"""Seed study: how well does softmax attention linearized into a gated delta rule (derived GDN,
model/ops/gated_delta/derived.py derived_gated_delta_rule) approximate softmax attention?

(a) Approximation table (always): relative error ||o - o_softmax|| / ||o_softmax|| against exact causal
    softmax attention softmax(s q.k / sqrt(d)) v on the same q, k, v, as the logit scale s grows, for
    random keys and structured ones (clustered, drifting), of
      - VaLA, the plain first-order expansion: o_t = vbar_t + ((1/t) sum_i v_i k_i^T - vbar_t kbar_t^T) q_t,
      - derived GDN, its recursion exactly, and with clamp_ktil (the derived_gdn mixer's default).
    q and k carry (s / sqrt(d))^1/2 each in both linearizations. Writes a markdown table and a PNG.

(b) Per-layer error on a trained model (--teacher DIR, a softmax run): each layer's mixer run on the teacher's
    own input to its attention (val sequences of the teacher's data, document-masked as in training), as
    ||y - y_teacher|| / ||y_teacher|| against the teacher's attention output, for VaLA (a quadratic-time
    reference core defined here), the `linear` mixer (elu+1, normalised) and derived GDN (exact and clamped),
    each zero-shot over the teacher's projections, and for each --students run as trained (a linearize run,
    e.g. one that ran only its transfer stage: training/objectives/linearize/ logs the same error while it trains).
    Writes layer_errors.md and a PNG. Linearizing the whole model (val loss zero-shot and after each stage) is
    train.py's: python train.py experiment=linearize init_from=<softmax run> (docs/linearize.md).

    python studies/linearize_error.py                        # part (a) only, outputs/linearize/
    python studies/linearize_error.py --teacher outputs/<softmax run> --students outputs/<linearize run> ...
"""
import argparse
import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from common.plots import legend_outside, pyplot, save_figure
from model import DecoderLM
from model.layers import AuxCollector
from model.mixers.attention_projections import project_qkv
from model.mixers.softmax import SoftmaxAttention
from model.ops.gated_delta import derived_gated_delta_rule
from model.ops.kernels import repeat_heads

ROOT = Path(__file__).resolve().parents[1]

SCALES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
METHODS = ["VaLA", "derived GDN (exact)", "derived GDN (clamp_ktil)"]


# (a) approximation error --------------------------------------------------------------------------
def softmax_attention(q, k, v, scale):
    """Causal softmax(scale q.k) v, q, k, v [B, T, H, d]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


def vala_attention(q, k, v, scale, mask=None):
    """o_t = vbar_t + ((1/t) sum_{i<=t} v_i k_i^T - vbar_t kbar_t^T) q_t, q and k times scale^1/2
    (quadratic-time form: (1/t) sum_i v_i (k_i . q_t) through the mask [B, T, T] of the keys each query
    sees: causal, or causal within the query's document segment)."""
    q, k = q * scale ** 0.5, k * scale ** 0.5
    B, T = q.shape[:2]
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril().expand(B, T, T)
    m = mask.to(q.dtype)
    t = m.sum(-1)[:, :, None, None]  # keys seen
    kbar, vbar = torch.einsum("bts,bshd->bthd", m, k) / t, torch.einsum("bts,bshd->bthd", m, v) / t
    qk = torch.einsum("bthd,bshd->bhts", q, k) * m[:, None]
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
    import matplotlib.ticker

    fig, axes = pyplot().subplots(1, len(errors), figsize=(4.5 * len(errors), 3.6), sharey=True)
    for ax, (kind, per_method) in zip(axes, errors.items()):
        for name, errs in per_method.items():
            ax.plot(SCALES, [min(e, 1e3) for e in errs], marker="o", label=name)
        ax.set(xscale="log", yscale="log", title=f"{kind} keys", xlabel="logit scale s (logits s q.k / sqrt(d))")
        ax.set_xticks(SCALES, [f"{s:g}" for s in SCALES], minor=False)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("||o - o_softmax|| / ||o_softmax|| (capped at 1e3)")
    legend_outside(axes[-1])
    save_figure(fig, path)


# (b) per-layer error on a trained teacher's own activations -----------------------------------------
class VaLAAttention(SoftmaxAttention):
    """Softmax attention's projections with the VaLA core (quadratic-time, no decoding cache; not a registered
    mixer: `with_core` puts it into a model). With document segments, every mean and sum runs within the
    token's own segment, t counting from its start."""

    def core(self, q, k, v, cache, aux, segments=None):
        if cache is not None:
            raise ValueError("vala is an evaluation-only reference core; it keeps no decoding cache")
        k, v = repeat_heads(k, self.num_heads), repeat_heads(v, self.num_heads)
        mask = None if segments is None else segments.attention_mask[:, 0]  # [B, T, T]: same segment, causal
        return vala_attention(q.float(), k.float(), v.float(), self.head_dim ** -0.5, mask).to(v.dtype)


def with_core(teacher: DecoderLM, mixer: str, **options) -> DecoderLM:
    """The teacher with every layer's mixer swapped to `mixer` over the same projections (vala: VaLAAttention),
    every weight the teacher's (strict)."""
    if mixer == "vala":
        model = copy.deepcopy(teacher)
        for i, block in enumerate(model.layers):
            vala = VaLAAttention(model.config, i)
            vala.load_state_dict(block.mixer.state_dict())
            block.mixer = vala
        return model
    config = copy.deepcopy(teacher.config)
    config.mixer, config.mixer_options = mixer, {mixer: options}
    model = DecoderLM(config)
    model.load_state_dict(teacher.state_dict())
    return model.eval()


def val_batches(teacher_dir: Path, sequences: int, batch_size: int) -> list[dict]:
    """The first `sequences` val sequences of the data the teacher was trained on (rebuilt from its
    training_config.yaml with its own tokenizer; cached, deterministic), with their document positions."""
    from omegaconf import OmegaConf

    from data import build_data
    from runs.checkpoint import weights_dir

    folder = weights_dir(teacher_dir)
    cfg = OmegaConf.load(folder / "training_config.yaml")
    data_cfg = OmegaConf.merge(cfg.data, {"tokenizer": str(folder)}) if cfg.data.get("tokenizer") == "bpe" else cfg.data
    val = build_data(data_cfg, cfg.trainer.seq_len, cfg.seed).val
    return [val.batch(idx) for idx in torch.arange(min(sequences, len(val))).split(batch_size)]


@torch.no_grad()
def layer_errors(teacher: DecoderLM, models: dict[str, DecoderLM], batches: list[dict]) -> tuple[dict, list[float]]:
    """({name: per layer ||y - y_teacher|| / ||y_teacher||}, per layer the std of the teacher's attention logits
    q.k / sqrt(d) over the pairs it attends): each model's mixer of layer i run on the teacher's own input to its
    layer-i attention, against the teacher's attention output (the transfer error of
    training/objectives/linearize/linearization.py), over all the batches. The logit std is part (a)'s logit scale
    s for unit-variance q and k."""
    from training.objectives.linearize.losses import mixer_io

    L = teacher.config.num_hidden_layers
    sq_err = {name: torch.zeros(L, dtype=torch.float64) for name in models}
    sq_ref = torch.zeros(L, dtype=torch.float64)
    logits = [[] for _ in range(L)]
    for batch in batches:
        with mixer_io(teacher) as io:
            teacher(batch["input_ids"], position_ids=batch.get("position_ids"), logits_to_keep=1)
        for i in range(L):
            x, segments, y_teacher = io[i]
            sq_ref[i] += y_teacher.double().pow(2).sum()
            for name, model in models.items():
                y = model.layers[i].mixer(x, None, AuxCollector(), segments)
                sq_err[name][i] += (y.double() - y_teacher.double()).pow(2).sum()
            attention = teacher.layers[i].mixer
            q, k, _ = project_qkv(attention, x, 0, None if segments is None else segments.position_ids)
            k = repeat_heads(k, attention.num_heads)
            scores = torch.einsum("bthd,bshd->bhts", q, k) * attention.head_dim ** -0.5
            T = x.shape[1]
            seen = (torch.ones(T, T, dtype=torch.bool).tril()[None] if segments is None
                    else segments.attention_mask[:, 0])[:, None].expand_as(scores)
            logits[i].append(scores[seen].double())
    return ({name: (err / sq_ref).sqrt().tolist() for name, err in sq_err.items()},
            [torch.cat(values).std().item() for values in logits])


ZERO_SHOT = [("VaLA", "vala", {}), ("linear (elu+1, normalised)", "linear", {}),
             ("derived GDN (exact)", "derived_gdn", {"clamp_ktil": False}),
             ("derived GDN (clamp_ktil)", "derived_gdn", {"clamp_ktil": True})]


def layer_error_table(args) -> tuple[str, dict[str, list[float]]]:
    """Zero-shot: every core over the teacher's projections; then each --students run (a linearize run, e.g.
    after its transfer stage) as trained. Rows: method, columns: layers and their mean."""
    from runs.checkpoint import load_lm

    teacher = load_lm(args.teacher).eval()
    batches = val_batches(Path(args.teacher), args.sequences, args.batch_size)
    models = {f"{name}, zero-shot": with_core(teacher, mixer, **options) for name, mixer, options in ZERO_SHOT}
    for path in args.students or []:
        models[f"{Path(path).name}, trained"] = load_lm(path).eval()
    errors, logit_std = layer_errors(teacher, models, batches)
    L = teacher.config.num_hidden_layers
    lines = ["| model | " + " | ".join(f"layer {i}" for i in range(L)) + " | mean |", "|---" * (L + 2) + "|",
             "| (the teacher's attention logits q.k / sqrt(d): std) | " + " | ".join(f"{v:.3g}" for v in logit_std)
             + f" | {sum(logit_std) / L:.3g} |"]
    lines += [f"| {name} | " + " | ".join(f"{e:.3g}" for e in errs) + f" | {sum(errs) / L:.3g} |"
              for name, errs in errors.items()]
    tokens = sum(b["input_ids"].numel() for b in batches)
    text = (f"Relative error ||y - y_teacher|| / ||y_teacher|| per layer on {tokens} val tokens of {args.teacher} (each layer's mixer "
            f"on the teacher's own input to its attention):\n\n" + "\n".join(lines))
    return text, errors


def plot_layer_errors(table: dict[str, list[float]], path: Path) -> None:
    L = len(next(iter(table.values())))
    width = 0.8 / len(table)
    fig, ax = pyplot().subplots(figsize=(1.6 * L + 4, 3.8))
    for j, (name, errs) in enumerate(table.items()):
        capped = [1e3 if not math.isfinite(e) else min(e, 1e3) for e in errs]  # a diverged recursion (nan) at the cap
        ax.bar([i + (j - (len(table) - 1) / 2) * width for i in range(L)], capped, width, label=name)
    ax.set(xticks=range(L), xticklabels=[f"layer {i}" for i in range(L)], yscale="log",
           ylabel="||y - y_teacher|| / ||y_teacher||\n(capped at 1e3; nan drawn there)",
           title="each mixer on the teacher's own attention input")
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(ax)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "linearize"))
    parser.add_argument("--teacher", help="a softmax run dir or HF dir (part b)")
    parser.add_argument("--students", nargs="*", help="linearize runs (or HF dirs) of that teacher, measured as trained")
    parser.add_argument("--sequences", type=int, default=64, help="val sequences measured")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = "## Approximation error vs exact causal softmax attention\n\n" + approximation_table(out)
    if args.teacher:
        text, table = layer_error_table(args)
        (out / "layer_errors.md").write_text(text + "\n")
        plot_layer_errors(table, out / "layer_errors.png")
        report += "\n\n## Per-layer error on the teacher's activations\n\n" + text
    (out / "report.md").write_text(report + "\n")
    print(report)
    print(f"\nwrote {out / 'report.md'}, {out / 'approximation_error.png'}"
          + (f", {out / 'layer_errors.png'}" if args.teacher else ""))


if __name__ == "__main__":
    main()
