"""The delta rule's chunked (WY) form, for training and prefill (the rule and its layouts: model/ops/gated_delta)."""
import torch

from model.ops.gated_delta.decayed_products import products_backward, products_forward
from model.ops.kernels import accumulation_dtype, kernel_runs, optional_kernel, own_precision
from model.ops.varlen import ChunkLayout, check_packed


CHUNK_SIZE = 32  # the CPU default: intra-chunk work per token grows with it, the recursion's steps shrink
SUB_BLOCK = 8  # a per-channel decay too fast to factor (decayed_products.py): sub-blocks of up to this many tokens
# fla's kernels (module, function) per decay form. DeltaNet's chunked form runs fla's GDN kernel with g = 0:
# fla's chunk_delta_rule refuses float32 inputs (an assert), which fp32 runs and the checks hand it.
CHUNK_KERNELS = {"none": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                 "per_head": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                 "per_channel": ("fla.ops.kda", "chunk_kda"),
                 "channel_gates": ("fla.ops.gdn2", "chunk_gdn2")}


def decay_form(k: torch.Tensor, g: torch.Tensor | None) -> str:
    """"none", "per_head" or "per_channel": which decay g [B, T, H] / [B, T, H, K] / None gives keys k [B, T, H, K]."""
    if g is None:
        return "none"
    if g.shape in (k.shape[:3], k.shape):
        return "per_head" if g.dim() == 3 else "per_channel"
    raise ValueError(f"g of shape {tuple(g.shape)}; valid: None, {tuple(k.shape[:3])} (per head) or "
                     f"{tuple(k.shape)} (per key channel)")


def channel_gates(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, write: torch.Tensor | None) -> bool:
    """Whether the gates are GDN-2's, per channel (an erase gate beta [B, T, H, K] and a write gate write [B, T, H, V]),
    rather than one beta [B, T, H] that erases and writes (write None; a write gate alone is GDN-2's with a scalar
    erase gate)."""
    if beta.shape not in (k.shape[:3], k.shape):
        raise ValueError(f"beta of shape {tuple(beta.shape)}; valid: {tuple(k.shape[:3])} (per head) or {tuple(k.shape)} "
                         "(an erase gate per key channel, with a write gate)")
    if write is None and beta.dim() == 4:
        raise ValueError("an erase gate per key channel (beta [B, T, H, K]) needs its write gate per value channel "
                         f"(write {tuple(v.shape)})")
    if write is not None and write.shape != v.shape:
        raise ValueError(f"write of shape {tuple(write.shape)}; valid: {tuple(v.shape)} (one gate per value channel)")
    return write is not None


def per_channel_gates(k, v, g, beta, write):
    """(g [B, T, H, K], erase [B, T, H, K or 1], write [B, T, H, V or 1]): the decay and the gates as the per-channel
    form takes them (a decay per head or none spread over the key channels, a scalar beta as both gates)."""
    g = k.new_zeros(k.shape) if g is None else g if g.dim() == 4 else g[..., None].expand(k.shape)
    erase = beta if beta.dim() == 4 else beta[..., None]
    return g, erase, beta[..., None] if write is None else write


@own_precision
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=CHUNK_SIZE, cu_seqlens=None, write=None, query_every=1):
    """Chunked (WY) delta rule with decay g (None, per head or per key channel) and gates beta, write (one beta per
    head, or GDN-2's erase and write gates per channel; module docstring); returns (o [B, T, H, V], final state
    [B, H, K, V] or None).

    Per chunk of C tokens with in-chunk cumulative log decay G and Gamma_ij = exp(G_i - G_j) (i >= j; per key
    channel d for a per-channel decay, Gamma_ijd, contracted inside the products below):
        (I + strictLower(diag(beta) (Gamma o K K^T))) [u | w] = [beta v | beta k exp(G)]
(with GDN-2's gates: (b o K) in place of diag(beta) K, and w o v in place of beta v)
        S_{n+1} = exp(G_C) S_n + kd^T (u - w S_n),   kd = k exp(G_C - G)   (state h, [K, V])
        o = scale [(q exp(G)) S_n + tril(Gamma o Q K^T) (u - w S_n)]
    Every exponent is <= 0. All chunks' intra-chunk work is batched; only the state recursion S_n -> S_{n+1}
    loops. A scalar decay per head (or none: g = 0) runs _ChunkedGatedDelta, a per-channel decay or per-channel
    gates _ChunkedPerChannel, each with its hand-written backward. The default C = 32 is the
    fastest on CPU for the scalar decay (fla's GPU kernel uses 64). With cu_seqlens every sequence is laid
    out on whole chunks (ChunkLayout) and the state entering a sequence's first chunk is dropped (e^G zeroed
    there).
    query_every = s > 1 (a scalar decay or none): q [B, T / s, H, K] holds only the queries at steps s - 1,
    2 s - 1, ... (the other steps' are zero, DeltaProduct's), o [B, T / s, H, V] the outputs there; the PyTorch
    form then takes the chunk as a multiple of s and runs the output side on those rows alone.
    """
    form = "channel_gates" if channel_gates(k, v, beta, write) else decay_form(k, g)
    fla_chunk = optional_kernel(*CHUNK_KERNELS[form], q)
    if query_every > 1 and (fla_chunk is not None or form not in ("none", "per_head")):
        o, S = chunk_gated_delta_rule(spread_queries(q, query_every), k, v, g, beta, scale, initial_state,
                                      output_final_state, chunk_size, cu_seqlens, write)
        return o[:, query_every - 1::query_every], S
    if fla_chunk is not None:
        if form == "channel_gates":  # fla's GDN-2 takes a decay and an erase gate per key channel
            g, b, write = per_channel_gates(k, v, g, beta, write)
            return fla_chunk(q, k, v, g=g.float(), b=b.expand(k.shape), w=write, scale=scale,
                             initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        g = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else g
        return fla_chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, cd = v.dtype, accumulation_dtype(v.dtype)
    scale = K ** -0.5 if scale is None else scale
    C = pytorch_chunk(chunk_size, T, query_every)
    if form in ("per_channel", "channel_gates"):
        core, inputs, rows = _ChunkedPerChannel.apply, (q, k, v, *per_channel_gates(k, v, g, beta, write)), ()
    else:
        core, inputs = _ChunkedGatedDelta.apply, (q, k, v, q.new_zeros(B, T, H) if g is None else g, beta)
        rows = (query_every,)
    if cu_seqlens is None:
        S0 = q.new_zeros(B * H, K, V, dtype=cd) if initial_state is None else initial_state.to(cd).reshape(B * H, K, V)
        o, S = core(*(x.to(cd) for x in inputs), S0, scale, C, None, None, *rows)
        return o.to(dtype), (S.view(B, H, K, V) if output_final_state else None)
    check_packed(q, cu_seqlens, initial_state)
    layout = ChunkLayout.build(cu_seqlens, C)
    # q's rows as their own layout: sequences of length / s tokens on chunks of C / s, the same chunks
    q_layout = layout if query_every == 1 else ChunkLayout.build(cu_seqlens // query_every, C // query_every)
    o, S = core(q_layout.pad(q.to(cd)), *(layout.pad(x.to(cd)) for x in inputs[1:]), q.new_zeros(H, K, V, dtype=cd),
                scale, C, layout.resets, layout.ends, *rows)
    return q_layout.unpad(o).to(dtype), (S if output_final_state else None)


def spread_queries(q: torch.Tensor, every: int) -> torch.Tensor:
    """q [B, T, H, *] as the queries of every `every`-th step of T every steps (at steps every - 1, 2 every - 1, ...),
    zeros at the others."""
    B, T = q.shape[:2]
    spread = q.new_zeros(B, T, every, *q.shape[2:])
    spread[:, :, -1] = q
    return spread.flatten(1, 2)


def _token_chunk_views(tokens: torch.Tensor, chunked: torch.Tensor, C: int) -> list[tuple]:
    """Matching views of tokens [B, T, H, *] and chunked [N, B, H, C, *] (T <= N C) over the T tokens:
    the full chunks, then the partial last one."""
    T = tokens.shape[1]
    full, rest = divmod(T, C)
    by_token = chunked.permute(1, 0, 3, 2, *range(4, chunked.dim()))  # [B, N, C, H, *]
    views = [(tokens[:, :full * C].unflatten(1, (full, C)), by_token[:, :full])] if full else []
    return views + ([(tokens[:, full * C:], by_token[:, full, :rest])] if rest else [])


def _to_chunks(x: torch.Tensor, C: int, scale=1.0) -> torch.Tensor:
    """[B, T, H, *] -> scale x as [N, B, H, C, *], contiguous, zero-padded to N C tokens, in one pass."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    out = (x.new_zeros if T % C else x.new_empty)(N, B, H, C, *x.shape[3:])
    for tok, chunk in _token_chunk_views(x, out, C):
        torch.mul(tok, scale, out=chunk)
    return out


def _from_chunks(x: torch.Tensor, T: int, scale=1.0) -> torch.Tensor:
    """[N, B, H, C, *] -> scale x over its first T tokens as [B, T, H, *], contiguous, in one pass."""
    N, B, H, C = x.shape[:4]
    out = x.new_empty(B, T, H, *x.shape[4:])
    for tok, chunk in _token_chunk_views(out, x, C):
        torch.mul(chunk, scale, out=tok)
    return out


def _state_recursion(u, w, kd, decay, S0, ends):
    """The chunks' state recursion, the one loop of the chunked forms: per chunk n, vnew_n = u_n - w_n S_n and
    S_{n+1} = decay_n S_n + kd_n^T vnew_n, over [B H]-batched matrices. u [N, B, H, C, V], w, kd [N, B, H, C, K],
    decay [N, B, H, 1 or K, 1] (the chunk's total decay e^{G_C}, per head or per key channel), S0 [B H, K, V].
    Returns (S_prev [N, B, H, K, V], the state entering each chunk; vnew [N, B, H, C, V]; the final state, or the
    states at `ends` [len(ends), B H, K, V])."""
    N, B, H, C, V = u.shape
    K = w.shape[-1]
    u3, w3, kd3 = u.view(N, B * H, C, V), w.view(N, B * H, C, K), kd.view(N, B * H, C, K)
    decay = decay.reshape(N, B * H, -1, 1)
    S_prev, vnew = u.new_empty(N + 1, B * H, K, V), torch.empty_like(u3)
    S_prev[0] = S0
    for n in range(N):
        torch.baddbmm(u3[n], w3[n], S_prev[n], alpha=-1, out=vnew[n])
        torch.baddbmm(S_prev[n] * decay[n], kd3[n].transpose(-1, -2), vnew[n], out=S_prev[n + 1])
    S = S_prev[N].clone() if ends is None else S_prev[ends]
    return S_prev[:N].view(N, B, H, K, V), vnew.view(N, B, H, C, V), S


def _state_recursion_backward(d_vnew, dS_out, dS_last, w, kd, decay, ends):
    """_state_recursion's backward, in reverse over the chunks, given the gradients that reach vnew [N, B, H, C, V] and
    S_prev [N, B, H, K, V] from the outputs, and dS_last that of its final state(s): (dS0 [B H, K, V], d_next
    [N, B, H, K, V] = dL/dS_{n+1}, du [N, B, H, C, V] = the total dL/dvnew_n)."""
    N, B, H, C, V = d_vnew.shape
    K = w.shape[-1]
    d_vnew, dS_out = d_vnew.reshape(N, B * H, C, V), dS_out.reshape(N, B * H, K, V)
    w3, kd3, decay = w.view(N, B * H, C, K), kd.view(N, B * H, C, K), decay.reshape(N, B * H, -1, 1)
    d_next, du = d_vnew.new_empty(N + 1, B * H, K, V), torch.empty_like(d_vnew)
    d_next[N] = dS_last if ends is None else dS_last[-1]  # autograd gives zeros for an unused output
    if ends is not None:  # the other sequences' final states are chunk-start states
        dS_out.index_add_(0, ends[:-1], dS_last[:-1])
    for n in range(N - 1, -1, -1):
        torch.baddbmm(d_vnew[n], kd3[n], d_next[n + 1], out=du[n])  # total d vnew_n
        torch.baddbmm(dS_out[n].addcmul_(d_next[n + 1], decay[n]), w3[n].transpose(-1, -2), du[n],
                      alpha=-1, out=d_next[n])
    return d_next[0], d_next[1:].view(N, B, H, K, V), du.view(N, B, H, C, V)


class _ChunkedGatedDelta(torch.autograd.Function):
    """The chunked gated delta rule: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], S0 [B H, K, V],
    scale, chunk size C, resets, ends -> o [B, T, H, V], S_N. Inside, everything is in chunks [N, B, H, C, *] (padded
    steps have k = 0, beta = 0, g = 0: they leave the state unchanged).

    Forward: u = inv (beta v), w = inv (beta k e^G), inv = (I + strictLower(Gamma o diag(beta) K K^T))^-1;
    per chunk vnew = u - w S, S <- e^{G_C} S + kd^T vnew; then o = scale [(q e^G) S + (Gamma o Q K^T) vnew].
    Backward by hand (faster on CPU than autograd through the same graph): the matmuls reversed, the
    state gradient in one reverse loop, and d inv folded into dA = -strictLower(inv^T [du | dw] [u | w]^T).
    resets [N] bool (or None): chunk n ignores the state entering it (its e^G is zeroed, so q e^G S_n,
    w S_n and e^{G_C} S_n vanish, in backward too); the second output is then S_ends [len(ends), B H, K, V].
    every = s: q [B, T / s, H, K] holds the queries of steps s - 1, 2 s - 1, ... alone (s divides C), the rows
    `rows` of each chunk: the output side (q e^G, Gamma o Q K^T and their products) is taken at those rows only.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale, C, resets, ends, every):
        T, Tq = k.shape[1], q.shape[1]
        q = _to_chunks(q, C // every)
        k, v, G, beta = (_to_chunks(x, C) for x in (k, v, g, beta))
        G = G.cumsum_(-1)
        rows = slice(every - 1, None, every)  # the query rows of a chunk
        N, B, H, _, K = k.shape
        V = v.shape[-1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        gamma = (G[..., :, None] - G[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
        eG, ed = G.exp(), (G[..., -1:] - G).exp_()
        if resets is not None:
            eG.masked_fill_(resets.view(N, 1, 1, 1), 0.0)
        kb = k * beta[..., None]
        kg, qg, kd = kb * eG[..., None], q * eG[..., rows, None], k * ed[..., None]
        kT = k.transpose(-1, -2)
        akk, aqk = (kb @ kT).mul_(gamma), (q @ kT).mul_(gamma[..., rows, :])
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(N, B, H, C, C)
        inv = torch.linalg.solve_triangular(akk, eye, upper=False, unitriangular=True)  # strict lower read
        u, w = inv @ (v * beta[..., None]), inv @ kg
        S_prev, vnew, S = _state_recursion(u, w, kd, eG[..., -1, None, None], S0, ends)
        Cq = C // every
        o = (qg @ S_prev).view(N * B * H, Cq, V).baddbmm_(aqk.view(-1, Cq, C), vnew.view(-1, C, V), alpha=1)
        ctx.save_for_backward(q, k, v, eG, ed, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew, kb, kg, qg, kd)
        ctx.scale, ctx.T, ctx.Tq, ctx.ends, ctx.rows = scale, T, Tq, ends, rows
        return _from_chunks(o.view(N, B, H, Cq, V), Tq, scale), S

    @staticmethod
    def backward(ctx, do, dS_last):
        q, k, v, eG, ed, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew, kb, kg, qg, kd = ctx.saved_tensors
        N, B, H, C, K = k.shape
        V, Cq, rows = v.shape[-1], q.shape[-2], ctx.rows
        do = _to_chunks(do, Cq, ctx.scale)  # the gradient of the unscaled o
        # o = qg S + aqk vnew
        d_aqk = do @ vnew.transpose(-1, -2)
        dS0, d_next, du = _state_recursion_backward(aqk.transpose(-1, -2) @ do, qg.transpose(-1, -2) @ do, dS_last,
                                                    w, kd, eG[..., -1, None, None], ctx.ends)
        dw_neg = du @ S_prev.transpose(-1, -2)  # -dL/dw
        d_kd = vnew @ d_next.transpose(-1, -2)
        # u = inv vb, w = inv kg
        d_vb, d_kg_neg = inv.transpose(-1, -2) @ du, inv.transpose(-1, -2) @ dw_neg
        dA = (d_kg_neg @ w.transpose(-1, -2)).view(-1, C, C).baddbmm_(
            d_vb.view(-1, C, V), u.view(-1, C, V).transpose(-1, -2), alpha=-1).view(N, B, H, C, C).tril_(-1)
        # akk = (kb k^T) o gamma, aqk = (q k^T) o gamma, gamma = exp(G_i - G_j)
        d_gamma = dA * akk  # d(G_i - G_j)
        d_gamma[..., rows, :].addcmul_(d_aqk, aqk)
        d_kbk, d_qk = dA.mul_(gamma), d_aqk.mul_(gamma[..., rows, :])
        d_kb = (d_kbk @ k).addcmul_(d_kg_neg, eG[..., None], value=-1)
        d_qg = do @ S_prev.transpose(-1, -2)
        dq = (d_qk @ k).addcmul_(d_qg, eG[..., rows, None])
        dk = (d_kbk.transpose(-1, -2) @ kb).view(-1, C, K).baddbmm_(
            d_qk.view(-1, Cq, C).transpose(-1, -2), q.view(-1, Cq, K)).view(N, B, H, C, K)
        dk.addcmul_(d_kb, beta[..., None]).addcmul_(d_kd, ed[..., None])
        dbeta = (d_vb * v).sum(-1) + (d_kb * k).sum(-1)
        dv = d_vb.mul_(beta[..., None])
        d_ed = (d_kd * kd).sum(-1)  # d(G_C - G)
        d_qgG = eG.new_zeros(eG.shape)  # d G through q e^G, at the query rows
        d_qgG[..., rows] = (d_qg * qg).sum(-1)
        dG = d_gamma.sum(-1) - d_gamma.sum(-2) + d_qgG - (d_kg_neg * kg).sum(-1) - d_ed
        dG[..., -1] += d_ed.sum(-1) + (d_next * S_prev).sum((-1, -2)) * eG[..., -1]
        dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g)
        T = ctx.T
        return (_from_chunks(dq, ctx.Tq), *(_from_chunks(x, T) for x in (dk, dv, dg, dbeta)), dS0,
                None, None, None, None, None)


class _ChunkedPerChannel(torch.autograd.Function):
    """_ChunkedGatedDelta for a decay per key channel, g [B, T, H, K], and gates per channel, erase [B, T, H, K or 1]
    and write [B, T, H, V or 1] (per_channel_gates; otherwise the same arguments, returns and resets / ends), its
    backward by hand the same way. Gamma_ijd = exp(G_id - G_jd) is contracted inside the products
    akk = P(b o k, k), aqk = P(q, k) (decayed_products.products_forward, both at once: a matmul each through the
    channels' mid decay, a chunk decaying too fast for it by sub-blocks of sub_block(C) tokens), so no factor
    overflows however strong the decay; e^{G_C} scales the state's rows."""

    @staticmethod
    def forward(ctx, q, k, v, g, erase, write, S0, scale, C, resets, ends):
        T = k.shape[1]
        q, k, v, G, erase, write = (_to_chunks(x, C) for x in (q, k, v, g, erase, write))  # [N, B, H, C, *]
        G = G.cumsum_(-2)
        N, B, H, _, K = k.shape
        V = v.shape[-1]
        eG, ed = G.exp(), (G[..., -1:, :] - G).exp_()
        if resets is not None:
            eG.masked_fill_(resets.view(N, 1, 1, 1, 1), 0.0)
        kb = k * erase
        kg, qg, kd = kb * eG, q * eG, k * ed
        (akk, aqk), products = products_forward((kb, q), k, G, sub_block(C))
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(N, B, H, C, C)
        inv = torch.linalg.solve_triangular(akk, eye, upper=False, unitriangular=True)  # strict lower read
        u, w = inv @ (v * write), inv @ kg
        S_prev, vnew, S = _state_recursion(u, w, kd, eG[..., -1, :, None], S0, ends)
        o = (qg @ S_prev).view(N * B * H, C, V).baddbmm_(aqk.reshape(-1, C, C), vnew.view(-1, C, V))
        ctx.save_for_backward(q, k, v, erase, write, eG, ed, kb, kg, qg, kd, aqk, inv, u, w, S_prev, vnew, *products)
        ctx.scale, ctx.T, ctx.ends = scale, T, ends
        return _from_chunks(o.view(N, B, H, C, V), T, scale), S

    @staticmethod
    def backward(ctx, do, dS_last):
        q, k, v, erase, write, eG, ed, kb, kg, qg, kd, aqk, inv, u, w, S_prev, vnew, *products = ctx.saved_tensors
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        do = _to_chunks(do, C, ctx.scale)  # the gradient of the unscaled o
        d_aqk = do @ vnew.transpose(-1, -2)
        dS0, d_next, du = _state_recursion_backward(aqk.transpose(-1, -2) @ do, qg.transpose(-1, -2) @ do, dS_last,
                                                    w, kd, eG[..., -1, :, None], ctx.ends)
        dw_neg = du @ S_prev.transpose(-1, -2)
        d_kd = vnew @ d_next.transpose(-1, -2)
        d_vw, d_kg_neg = inv.transpose(-1, -2) @ du, inv.transpose(-1, -2) @ dw_neg
        dA = (d_kg_neg @ w.transpose(-1, -2)).view(-1, C, C).baddbmm_(
            d_vw.view(-1, C, V), u.view(-1, C, V).transpose(-1, -2), alpha=-1).view(N, B, H, C, C).tril_(-1)
        (d_kb, dq), dk, dG = products_backward(products, (dA, d_aqk))
        d_kb, dq, dk, dG = (x.view(N, B, H, C, K) for x in (d_kb, dq, dk, dG))
        d_kb.addcmul_(d_kg_neg, eG, value=-1)  # kg = kb e^G
        d_qg = do @ S_prev.transpose(-1, -2)
        dq.addcmul_(d_qg, eG)
        d_erase, d_write = d_kb * k, d_vw * v
        dk.addcmul_(d_kb, erase).addcmul_(d_kd, ed)
        dv = d_vw.mul_(write)
        d_ed = d_kd.mul_(kd)  # d(G_C - G)
        dG.addcmul_(d_qg, qg).addcmul_(d_kg_neg, kg, value=-1).sub_(d_ed)
        dG[..., -1, :] += d_ed.sum(-2) + (d_next * S_prev).sum(-1) * eG[..., -1, :]
        dg = dG.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g)
        # a gate of one channel (KDA's beta) gets its channels' sum
        d_erase, d_write = (d if x.shape[-1] == d.shape[-1] else d.sum(-1, keepdim=True)
                            for x, d in ((erase, d_erase), (write, d_write)))
        T = ctx.T
        return (*(_from_chunks(x, T) for x in (dq, dk, dv, dg, d_erase, d_write)), dS0, None, None, None, None)


def sub_block(C: int) -> int:
    """The sub-block of a chunk of C tokens in the per-channel products: the largest divisor of C up to SUB_BLOCK."""
    return next(c for c in range(min(SUB_BLOCK, C), 0, -1) if C % c == 0)


FLA_CHUNK_SIZE = 64  # the chunk of fla's chunk_gated_delta_rule and chunk_kda (their default; our calls pass none)


def pytorch_chunk(chunk_size: int, seq_len: int, query_every: int = 1) -> int:
    """The PyTorch form's chunk: chunk_size rounded down to a multiple of query_every (at least one), at most the
    sequence (a multiple of query_every)."""
    return min(max(chunk_size // query_every, 1) * query_every, seq_len)


def chunk_size_on(device, chunk_size: int, seq_len: int, per_channel: bool = False, query_every: int = 1) -> int:
    """The chunk chunk_gated_delta_rule runs at on `device`: fla's where its kernel runs (CUDA; chunk_kda for a
    decay per key channel), else the PyTorch form's (pytorch_chunk)."""
    kernel = "fla.ops.kda" if per_channel else "fla.ops.gated_delta_rule"
    return FLA_CHUNK_SIZE if kernel_runs(kernel, device) else pytorch_chunk(chunk_size, seq_len, query_every)


def chunk_gated_delta_flops(head_k_dim: int, head_v_dim: int, seq_len: int, chunk_size: int,
                            query_every: int = 1) -> float:
    """Forward FLOPs per token per head of the chunked (WY) delta rule at chunk C = chunk_size (chunk_size_on),
    the sequence padded to whole chunks, 2 per multiply-add. Per chunk: k k^T and q k^T (C^2 K each); the
    unit-lower-triangular solve against the identity (C (C - 1) / 2 multiply-adds per column, C columns);
    [u | w] = inv [beta v | beta k e^G] (C^2 (V + K)); w S and kd^T vnew in the state recursion and q S (C K V
    each); the intra-chunk (Gamma o q k^T) vnew (C^2 V). The same for a decay per key channel, whose k k^T and q k^T
    are whole matmuls too (decayed_products.py; a chunk decaying too fast for them adds its sub-block path's).
    With query_every = s the output side (q k^T, q S, the intra-chunk product) runs at the C / s query rows alone."""
    K, V, C = head_k_dim, head_v_dim, chunk_size
    Cq = C // query_every
    chunks = -(-seq_len // C)
    per_chunk = 2 * (C * C * K + Cq * C * K + C * C * (C - 1) / 2 + C * C * (V + K) + 2 * C * K * V + Cq * K * V
                     + Cq * C * V)
    return chunks * per_chunk / seq_len
