"""The delta rule's chunked (WY) form, for training and prefill (the rule and its layouts: model/ops/gated_delta)."""
import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, kernel_runs, optional_kernel, own_precision
from model.ops.varlen import ChunkLayout, check_packed


CHUNK_SIZE = 32  # the CPU default: intra-chunk work per token grows with it, the recursion's steps shrink
SUB_BLOCK = 8  # a per-channel decay's exact pairs (_decayed_products): sub-blocks of up to this many tokens
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
                           chunk_size=CHUNK_SIZE, cu_seqlens=None, write=None):
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
    loops. A scalar decay per head (or none: g = 0) runs _ChunkedGatedDelta with its hand-written backward;
    a per-channel decay or per-channel gates run _chunked_per_channel, differentiated by autograd. The default C = 32 is the
    fastest on CPU for the scalar decay (fla's GPU kernel uses 64). With cu_seqlens every sequence is laid
    out on whole chunks (ChunkLayout) and the state entering a sequence's first chunk is dropped (e^G zeroed
    there).
    """
    form = "channel_gates" if channel_gates(k, v, beta, write) else decay_form(k, g)
    fla_chunk = optional_kernel(*CHUNK_KERNELS[form], q)
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
    C = min(chunk_size, T)
    if form in ("per_channel", "channel_gates"):
        core, inputs = _chunked_per_channel, (q, k, v, *per_channel_gates(k, v, g, beta, write))
    else:
        core, inputs = _ChunkedGatedDelta.apply, (q, k, v, q.new_zeros(B, T, H) if g is None else g, beta)
    if cu_seqlens is None:
        S0 = q.new_zeros(B * H, K, V, dtype=cd) if initial_state is None else initial_state.to(cd).reshape(B * H, K, V)
        o, S = core(*(x.to(cd) for x in inputs), S0, scale, C, None, None)
        return o.to(dtype), (S.view(B, H, K, V) if output_final_state else None)
    check_packed(q, cu_seqlens, initial_state)
    layout = ChunkLayout.build(cu_seqlens, C)
    o, S = core(*(layout.pad(x.to(cd)) for x in inputs), q.new_zeros(H, K, V, dtype=cd),
                scale, C, layout.resets, layout.ends)
    return layout.unpad(o).to(dtype), (S if output_final_state else None)


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
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, scale, C, resets, ends):
        T = k.shape[1]
        q, k, v, G, beta = (_to_chunks(x, C) for x in (q, k, v, g, beta))
        G = G.cumsum_(-1)
        N, B, H, _, K = k.shape
        V = v.shape[-1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        gamma = (G[..., :, None] - G[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
        eG, ed = G.exp(), (G[..., -1:] - G).exp_()
        if resets is not None:
            eG.masked_fill_(resets.view(N, 1, 1, 1), 0.0)
        kb = k * beta[..., None]
        kg, qg, kd = kb * eG[..., None], q * eG[..., None], k * ed[..., None]
        kT = k.transpose(-1, -2)
        akk, aqk = (kb @ kT).mul_(gamma), (q @ kT).mul_(gamma)
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(N, B, H, C, C)
        inv = torch.linalg.solve_triangular(akk, eye, upper=False, unitriangular=True)  # strict lower read
        u, w = inv @ (v * beta[..., None]), inv @ kg
        # the state recursion, over [B H]-batched matrices; S_prev[n] is the state entering chunk n
        u3, w3, kd3 = u.view(N, B * H, C, V), w.view(N, B * H, C, K), kd.view(N, B * H, C, K)
        decay = eG[..., -1].reshape(N, B * H, 1, 1)
        S_prev, vnew = q.new_empty(N + 1, B * H, K, V), torch.empty_like(u3)
        S_prev[0] = S0
        for n in range(N):
            torch.baddbmm(u3[n], w3[n], S_prev[n], alpha=-1, out=vnew[n])
            torch.baddbmm(S_prev[n] * decay[n], kd3[n].transpose(-1, -2), vnew[n], out=S_prev[n + 1])
        S = S_prev[N].clone() if ends is None else S_prev[ends]
        S_prev, vnew = S_prev[:N].view(N, B, H, K, V), vnew.view(N, B, H, C, V)
        o = (qg @ S_prev).view(N * B * H, C, V).baddbmm_(aqk.view(-1, C, C), vnew.view(-1, C, V), alpha=1)
        ctx.save_for_backward(q, k, v, eG, ed, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew, kb, kg, qg, kd)
        ctx.scale, ctx.T, ctx.ends = scale, T, ends
        return _from_chunks(o.view(N, B, H, C, V), T, scale), S

    @staticmethod
    def backward(ctx, do, dS_last):
        q, k, v, eG, ed, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew, kb, kg, qg, kd = ctx.saved_tensors
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        do = _to_chunks(do, C, ctx.scale)  # the gradient of the unscaled o
        # o = qg S + aqk vnew
        d_aqk = do @ vnew.transpose(-1, -2)
        d_vnew = (aqk.transpose(-1, -2) @ do).view(N, B * H, C, V)
        dS_out = (qg.transpose(-1, -2) @ do).view(N, B * H, K, V)
        # per chunk, in reverse: vnew = u - w S,  S' = e^{G_C} S + kd^T vnew; d_next[n] = dL/dS_{n+1}
        decay = eG[..., -1].reshape(N, B * H, 1, 1)
        w3, kd3 = w.view(N, B * H, C, K), kd.view(N, B * H, C, K)
        d_next, du = q.new_empty(N + 1, B * H, K, V), torch.empty_like(d_vnew)
        d_next[N] = dS_last if ctx.ends is None else dS_last[-1]  # autograd gives zeros for an unused output
        if ctx.ends is not None:  # the other sequences' final states are chunk-start states
            dS_out.index_add_(0, ctx.ends[:-1], dS_last[:-1])
        for n in range(N - 1, -1, -1):
            torch.baddbmm(d_vnew[n], kd3[n], d_next[n + 1], out=du[n])  # total d vnew_n
            torch.baddbmm(dS_out[n].addcmul_(d_next[n + 1], decay[n]), w3[n].transpose(-1, -2), du[n],
                          alpha=-1, out=d_next[n])
        dS0, d_next = d_next[0], d_next[1:].view(N, B, H, K, V)
        du = du.view(N, B, H, C, V)
        dw_neg = du @ S_prev.transpose(-1, -2)  # -dL/dw
        d_kd = vnew @ d_next.transpose(-1, -2)
        # u = inv vb, w = inv kg
        d_vb, d_kg_neg = inv.transpose(-1, -2) @ du, inv.transpose(-1, -2) @ dw_neg
        dA = (d_kg_neg @ w.transpose(-1, -2)).view(-1, C, C).baddbmm_(
            d_vb.view(-1, C, V), u.view(-1, C, V).transpose(-1, -2), alpha=-1).view(N, B, H, C, C).tril_(-1)
        # akk = (kb k^T) o gamma, aqk = (q k^T) o gamma, gamma = exp(G_i - G_j)
        d_gamma = (dA * akk).addcmul_(d_aqk, aqk)  # d(G_i - G_j)
        d_kbk, d_qk = dA.mul_(gamma), d_aqk.mul_(gamma)
        d_kb = (d_kbk @ k).addcmul_(d_kg_neg, eG[..., None], value=-1)
        d_qg = do @ S_prev.transpose(-1, -2)
        dq = (d_qk @ k).addcmul_(d_qg, eG[..., None])
        dk = (d_kbk.transpose(-1, -2) @ kb).view(-1, C, K).baddbmm_(
            d_qk.view(-1, C, C).transpose(-1, -2), q.view(-1, C, K)).view(N, B, H, C, K)
        dk.addcmul_(d_kb, beta[..., None]).addcmul_(d_kd, ed[..., None])
        dbeta = (d_vb * v).sum(-1) + (d_kb * k).sum(-1)
        dv = d_vb.mul_(beta[..., None])
        d_ed = (d_kd * kd).sum(-1)  # d(G_C - G)
        dG = d_gamma.sum(-1) - d_gamma.sum(-2) + (d_qg * qg).sum(-1) - (d_kg_neg * kg).sum(-1) - d_ed
        dG[..., -1] += d_ed.sum(-1) + (d_next * S_prev).sum((-1, -2)) * eG[..., -1]
        dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g)
        T = ctx.T
        return (*(_from_chunks(x, T) for x in (dq, dk, dv, dg, dbeta)), dS0, None, None, None, None)


def _chunked_per_channel(q, k, v, g, erase, write, S0, scale, C, resets, ends):
    """_ChunkedGatedDelta's forward for a decay per key channel, g [B, T, H, K], and gates per channel, erase
    [B, T, H, K or 1] and write [B, T, H, V or 1] (per_channel_gates; otherwise the same arguments and returns), in
    differentiable ops: autograd gives the backward. Gamma_ijd = exp(G_id - G_jd) is built per channel for
    i >= j only, by sub-blocks (_decayed_products), so no exponent is positive however strong the decay."""
    T = k.shape[1]
    q, k, v, G, erase, write = (_differentiable_chunks(x, C) for x in (q, k, v, g, erase, write))  # [N, B, H, C, *]
    G = G.cumsum(-2)
    N, B, H, _, K = k.shape
    V = v.shape[-1]
    eG, ed = G.exp(), (G[..., -1:, :] - G).exp()
    if resets is not None:
        eG = eG.masked_fill(resets.view(N, 1, 1, 1, 1), 0.0)
    kb = k * erase
    akk = _decayed_products(kb, k, G).tril(-1)
    aqk = _decayed_products(q, k, G)
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(N, B, H, C, C)
    inv = torch.linalg.solve_triangular(akk, eye, upper=False, unitriangular=True)
    u, w = inv @ (v * write), inv @ (kb * eG)
    kd, decay = (k * ed).transpose(-1, -2), eG[..., -1, :, None].reshape(N, B * H, K, 1)
    # only the state recursion loops, over [B H]-batched matrices, each operand split once (indexing a tensor per
    # chunk would give its backward one full-size zero fill per chunk); the outputs are batched after it
    states, vnews = [S0], []
    for u_n, w_n, kd_n, decay_n in zip(u.unbind(0), w.unbind(0), kd.unbind(0), decay.unbind(0)):
        vnews.append(u_n - w_n @ states[-1].view(B, H, K, V))
        states.append(states[-1] * decay_n + (kd_n @ vnews[-1]).view(B * H, K, V))
    entering = torch.stack(states[:-1]).view(N, B, H, K, V)
    o = ((q * eG) @ entering + aqk @ torch.stack(vnews)) * scale
    final = states[-1] if ends is None else torch.stack(states)[ends]
    return o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T], final


def sub_block(C: int) -> int:
    """The sub-block of a chunk of C tokens in _decayed_products: the largest divisor of C up to SUB_BLOCK."""
    return next(c for c in range(min(SUB_BLOCK, C), 0, -1) if C % c == 0)


def _decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """P_ij = sum_d a_id b_jd exp(G_id - G_jd) for i >= j, 0 above the diagonal; a, b, G [..., C, d_k], G the
    cumulative log decay (non-increasing in i). With only non-positive exponents: the chunk is cut into sub-blocks
    of `block` tokens; a pair in different sub-blocks factors through r, the first token of i's sub-block
    (j < r <= i), as (a_i exp(G_i - G_r)) . (b_j exp(G_r - G_j)), a matmul; a pair inside one sub-block takes
    exp(G_i - G_j) per channel (block (block - 1) / 2 d_k numbers per sub-block, the diagonal's being 1).
    block: sub_block(C). Differentiated by _DecayedProducts's own backward, by the same split."""
    return _DecayedProducts.apply(a, b, G)


def _in_sub_blocks(x: torch.Tensor, c: int) -> list[torch.Tensor]:
    """Views of x [M, C, C] at its pairs inside one sub-block of c tokens (C = nb c), by offset: [M, nb, c - o] at
    (i, i - o), i and i - o in the same sub-block, for o = 0 .. c - 1."""
    M, C = x.shape[0], x.shape[-1]
    blocks = x.view(M, C // c, c, C // c, c).diagonal(dim1=1, dim2=3)  # [M, c, c, nb]: the sub-blocks on the diagonal
    return [blocks.diagonal(-o, dim1=1, dim2=2) for o in range(c)]


class _DecayedProducts(torch.autograd.Function):
    """_decayed_products with a hand-written backward. The forward computes only the pairs it keeps: sub-block n's
    rows against the n c columns before it (one bmm each, b's factors exp(G_r - G_j) for j < r only), and the pairs
    inside a sub-block by offset o = i - j, gamma_o = exp(G_i - G_{i-o}) packed for o > 0 (the diagonal's is 1),
    never the masked rest of the grid. The backward, of the lower triangle of dP only:
    da_i = sum_j dP_ij b_j exp(G_i - G_j), db_j = sum_i dP_ij a_i exp(G_i - G_j) by the same split (the same
    factors, saved: bmm across sub-blocks, gamma inside them), and dG = a da - b db (G_i enters with +, G_j with -);
    no exponent is positive in either direction."""

    @staticmethod
    def forward(ctx, a, b, G):
        shape = G.shape
        C, K = shape[-2:]
        c = sub_block(C)
        nb = C // c
        a, b, G = (x.reshape(-1, nb, c, K) for x in (a, b, G))  # contiguous (the chunked views are not)
        M = G.shape[0]
        out = G.new_zeros(M, C, C)
        # across sub-blocks: the rows of sub-block n (r = n c, its first token) against every j < r, through r
        ref = G[:, :, :1]
        ea = torch.sub(G, ref).exp_()
        a_ref = a * ea
        b_flat, G_flat = b.view(M, C, K), G.view(M, C, K)
        cross = []
        for n in range(1, nb):
            eb = torch.sub(ref[:, n], G_flat[:, :n * c]).exp_()
            b_ref = eb * b_flat[:, :n * c]
            # a fresh product, then copied: baddbmm_ into the strided view would loop matrix by matrix
            out[:, n * c:(n + 1) * c, :n * c] = torch.bmm(a_ref[:, n], b_ref.transpose(1, 2))
            cross += [eb, b_ref]
        # inside a sub-block, offset o > 0: gamma [M, nb, sum_o (c - o), K], offset o at rows starts[o]:starts[o + 1]
        starts = _offset_starts(c)
        gamma = G.new_empty(M, nb, starts[-1], K)
        for o in range(1, c):
            torch.sub(G[:, :, o:], G[:, :, :c - o], out=gamma[:, :, starts[o]:starts[o + 1]])
        gamma.exp_()
        pairs = _in_sub_blocks(out, c)
        tmp = a * b
        pairs[0].copy_(tmp.sum(-1))
        for o in range(1, c):  # one sub-block's worth of a_i b_j gamma_ij at a time (tmp stays in cache)
            t = torch.mul(a[:, :, o:], b[:, :, :c - o], out=tmp[:, :, :c - o])
            pairs[o].copy_(t.mul_(gamma[:, :, starts[o]:starts[o + 1]]).sum(-1))
        ctx.save_for_backward(a, b, ea, a_ref, gamma, *cross)
        ctx.shape = shape
        return out.view(shape[:-1] + (C,))

    @staticmethod
    def backward(ctx, dP):
        a, b, ea, a_ref, gamma, *cross = ctx.saved_tensors
        M, nb, c, K = a.shape
        C = nb * c
        dP = dP.reshape(M, C, C).contiguous()  # a sum's gradient comes expanded (stride 0): bmm would loop over it
        starts = _offset_starts(c)
        pairs = _in_sub_blocks(dP, c)
        da, db = b * pairs[0][..., None], a * pairs[0][..., None]
        tmp = torch.empty_like(a)
        for o in range(1, c):
            x = torch.mul(gamma[:, :, starts[o]:starts[o + 1]], pairs[o][..., None], out=tmp[:, :, :c - o])
            da[:, :, o:].addcmul_(x, b[:, :, :c - o])
            db[:, :, :c - o].addcmul_(x, a[:, :, o:])
        db_flat = db.view(M, C, K)
        for n in range(1, nb):
            eb, b_ref = cross[2 * n - 2:2 * n]
            dPn = dP[:, n * c:(n + 1) * c, :n * c]
            da[:, n].addcmul_(torch.bmm(dPn, b_ref), ea[:, n])
            db_flat[:, :n * c].addcmul_(torch.bmm(dPn.transpose(1, 2), a_ref[:, n]), eb)
        dG = torch.mul(a, da).addcmul_(b, db, value=-1)
        return tuple(x.view(ctx.shape) for x in (da, db, dG))


def _offset_starts(c: int) -> list[int]:
    """Where offset o (1 <= o < c) starts in _DecayedProducts's packed gamma, o = c the end; [0] at o = 0 (unused)."""
    return [0] + [(o - 1) * c - (o - 1) * o // 2 for o in range(1, c + 1)]


def _differentiable_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *] -> [N, B, H, C, *] zero-padded to N C tokens, in ops autograd differentiates (_to_chunks
    writes into a buffer)."""
    T = x.shape[1]
    pad = -T % C
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
    return x.unflatten(1, (-1, C)).permute(1, 0, 3, 2, *range(4, x.dim() + 1))


FLA_CHUNK_SIZE = 64  # the chunk of fla's chunk_gated_delta_rule and chunk_kda (their default; our calls pass none)


def chunk_size_on(device, chunk_size: int, seq_len: int, per_channel: bool = False) -> int:
    """The chunk chunk_gated_delta_rule runs at on `device`: fla's where its kernel runs (CUDA; chunk_kda for a
    decay per key channel), else min(chunk_size, seq_len) as the PyTorch form takes it."""
    kernel = "fla.ops.kda" if per_channel else "fla.ops.gated_delta_rule"
    return FLA_CHUNK_SIZE if kernel_runs(kernel, device) else min(chunk_size, seq_len)


def chunk_gated_delta_flops(head_k_dim: int, head_v_dim: int, seq_len: int, chunk_size: int,
                            per_channel: bool = False) -> float:
    """Forward FLOPs per token per head of the chunked (WY) delta rule at chunk C = chunk_size (chunk_size_on),
    the sequence padded to whole chunks, 2 per multiply-add. Per chunk: k k^T and q k^T (C^2 K each); the
    unit-lower-triangular solve against the identity (C (C - 1) / 2 multiply-adds per column, C columns);
    [u | w] = inv [beta v | beta k e^G] (C^2 (V + K)); w S and kd^T vnew in the state recursion and q S (C K V
    each); the intra-chunk (Gamma o q k^T) vnew (C^2 V). A decay per key channel (per_channel) computes k k^T and
    q k^T as _decayed_products does: besides the C^2 K matmul across sub-blocks, each pair within a sub-block of c
    tokens weighs its K terms by their own decays (C c K each)."""
    K, V, C = head_k_dim, head_v_dim, chunk_size
    chunks = -(-seq_len // C)
    per_chunk = 2 * (2 * C * C * K + C * C * (C - 1) / 2 + C * C * (V + K) + 3 * C * K * V + C * C * V)
    if per_channel:
        per_chunk += 2 * 2 * C * sub_block(C) * K
    return chunks * per_chunk / seq_len


