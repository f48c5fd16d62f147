"""The delta-rule family's training cost beside softmax attention, forward and backward apart.

Op: model/ops/gated_delta on CPU float32 at B 1, T 2048, H 4, K = V 64 (T 128 with --quick), inputs as the mixers
hand them over (q, k L2-normed; log decays logsigmoid(N(2, 1)); gates sigmoid(N(0, 1))):
  - gdn: chunk_gated_delta_rule, g [B, T, H] (hand-written backward, _ChunkedGatedDelta);
  - deltanet: the same with g None;
  - kda: g [B, T, H, K], beta [B, T, H] (_ChunkedPerChannel, backward by hand);
  - gdn2: g [B, T, H, K], erase beta [B, T, H, K], write [B, T, H, V] (_ChunkedPerChannel, backward by hand);
  - deltaproduct n = 2, 3: chunk_gated_delta_product, k, v, beta over T n steps (the rule on the interleaved
    sequence, _ChunkedGatedDelta's backward);
against softmax: torch SDPA, causal, on the same q, k, v ([B, H, T, D]).

Mixer: one layer of each (model.registry MIXERS, each mixer's default options, d 256, 4 heads of 64; deltaproduct
also at num_householder 3) on x [B, T, d].

Each case is timed as its forward alone (building the autograd graph, as training does) and as forward + backward
of the output's sum; backward = (fwd + bwd) - fwd. Times are 1-thread process CPU time (time.process_time), the
cases taking turns over rounds, medians: on a shared 2-core machine 2-thread wall time stalls by 10-100x whenever
another process holds a core, CPU time on one thread barely moves. Ratios are of times (> 1: slower than the peer).
"""
import torch
import torch.nn.functional as F

from model import MIXERS, LMConfig
from model.ops.gated_delta import chunk_gated_delta_rule
from model.ops.gated_delta.product import chunk_gated_delta_product
from scripts.benchmarks.common import cpu_times, markdown_table

HEADS, HEAD_DIM, D = 4, 64, 256
PRODUCT_STEPS = (2, 3)  # deltaproduct's num_householder


def op_inputs(B: int, T: int, seed: int = 0) -> dict:
    """Each op's name -> (its function of the inputs, the inputs as leaves that require grad, their shapes in words)."""
    g = torch.Generator().manual_seed(seed)
    H, K = HEADS, HEAD_DIM

    def unit(*shape):  # L2-normed per head, as the mixers hand q and k over
        return F.normalize(torch.randn(*shape, generator=g), dim=-1)

    def gate(*shape):
        return torch.randn(*shape, generator=g).sigmoid()

    def log_decay(*shape):
        return F.logsigmoid(torch.randn(*shape, generator=g) + 2)

    q, k, v = unit(B, T, H, K), unit(B, T, H, K), torch.randn(B, T, H, K, generator=g)
    qkv = f"q, k, v [{B}, {T}, {H}, {K}]"
    cases = {
        "softmax (SDPA causal)": (lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True), (q, k, v), qkv),
        "gdn": (lambda *a: chunk_gated_delta_rule(*a)[0], (q, k, v, log_decay(B, T, H), gate(B, T, H)),
                f"{qkv}; g, beta [B, T, H]"),
        "deltanet": (lambda q, k, v, beta: chunk_gated_delta_rule(q, k, v, None, beta)[0], (q, k, v, gate(B, T, H)),
                     f"{qkv}; beta [B, T, H]"),
        "kda": (lambda *a: chunk_gated_delta_rule(*a)[0], (q, k, v, log_decay(B, T, H, K), gate(B, T, H)),
                f"{qkv}; g [B, T, H, K], beta [B, T, H]"),
        "gdn2": (lambda q, k, v, g, erase, write: chunk_gated_delta_rule(q, k, v, g, erase, write=write)[0],
                 (q, k, v, log_decay(B, T, H, K), gate(B, T, H, K), gate(B, T, H, K)),
                 f"{qkv}; g, erase [B, T, H, K], write [B, T, H, V]"),
    }
    for n in PRODUCT_STEPS:
        cases[f"deltaproduct n={n}"] = (
            lambda q, k, v, g, beta, n=n: chunk_gated_delta_product(q, k, v, g, beta, n)[0],
            (q, unit(B, T * n, H, K), torch.randn(B, T * n, H, K, generator=g), log_decay(B, T, H),
             gate(B, T * n, H)),
            f"q [{B}, {T}, {H}, {K}]; k, v [{B}, {T * n}, {H}, {K}], beta [B, T n, H]; g [B, T, H]")
    return {name: (fn, [x.clone().requires_grad_() for x in args], shapes)
            for name, (fn, args, shapes) in cases.items()}


def mixer_layers(B: int, T: int) -> dict:
    """Each case's name -> (its one-layer function of x, x, its shape in words, d_v and parameters): softmax and the
    delta-rule mixers (model.registry MIXERS), each at its default options."""
    cases = [(m, m, {}) for m in ("softmax", "gdn", "deltanet", "kda", "gdn2")] + [
        (f"deltaproduct n={n}", "deltaproduct", {"num_householder": n}) for n in PRODUCT_STEPS]
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = {}
    for label, name, options in cases:
        torch.manual_seed(0)
        config = LMConfig(hidden_size=D, num_attention_heads=HEADS, max_position_embeddings=T, mixer=name,
                          mixer_options={name: options})
        layer = MIXERS.get(name)(config, 0)
        layer.init_parameters()
        v_dim = getattr(layer, "head_v_dim", getattr(layer, "head_dim", None))
        out[label] = (lambda x, layer=layer: layer(x), [x],
                      f"x [{B}, {T}, {D}]; d_v {v_dim}; {sum(p.numel() for p in layer.parameters()) / 1e3:.0f}k params")
    return out


def time_cases(cases: dict, rounds: int, iters: int) -> dict:
    """Each case's median 1-thread CPU seconds of (forward, forward + backward), the cases and the two taking turns."""
    def forward(fn, args):
        return lambda: fn(*args)

    def forward_backward(fn, args):
        def step():
            fn(*args).sum().backward()
            for a in args:
                a.grad = None
        return step

    steps = {(name, part): make(fn, args) for name, (fn, args, _) in cases.items()
             for part, make in (("fwd", forward), ("fwd+bwd", forward_backward))}
    times = {key: [] for key in steps}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            for key, step in steps.items():
                times[key] += cpu_times(step, iters)
    finally:
        torch.set_num_threads(threads)
    median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    return {name: (median[name, "fwd"], median[name, "fwd+bwd"]) for name in cases}


def table(cases: dict, times: dict, softmax: str) -> str:
    gdn_fwd, gdn_step = times["gdn"]
    rows = []
    for name, (fwd, step) in times.items():
        bwd = step - fwd
        rows.append([name, cases[name][2], f"{fwd * 1e3:.1f}", f"{bwd * 1e3:.1f}", f"{step * 1e3:.1f}",
                     f"{bwd / step:.0%}", f"{step / times[softmax][1]:.2f}", f"{step / gdn_step:.2f}",
                     f"{fwd / gdn_fwd:.2f}", f"{bwd / (gdn_step - gdn_fwd):.2f}"])
    return markdown_table(["case", "inputs", "fwd ms", "bwd ms", "fwd+bwd ms", "bwd share", "time / softmax",
                           "time / gdn", "fwd / gdn fwd", "bwd / gdn bwd"], rows)


def run(quick: bool) -> str:
    B, T = (1, 128) if quick else (1, 2048)
    rounds, iters = (2, 1) if quick else (5, 1)
    ops, layers = op_inputs(B, T), mixer_layers(B, T)
    op_times = time_cases(ops, rounds, iters)
    layer_times = time_cases(layers, rounds, iters)
    how = (f"1-thread process CPU ms, median of {rounds} interleaved rounds x {iters} (after a warm-up call each); "
           "bwd = (fwd+bwd) - fwd; ratios of fwd+bwd times unless named")
    return "\n\n".join([
        f"Ops, float32, B {B}, T {T}, H {HEADS}, K = V {HEAD_DIM} ({how}):",
        table(ops, op_times, "softmax (SDPA causal)"),
        f"One mixer layer, d {D}, {HEADS} heads, each mixer's default options, B {B}, T {T} ({how}):",
        table(layers, layer_times, "softmax"),
    ])
