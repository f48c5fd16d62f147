"""The per-channel decayed products of the chunked delta rule's per-channel form (chunk.py), forward and backward
by hand: P_ij = sum_d a_id b_jd exp(G_id - G_jd) for i >= j, 0 above the diagonal, no factor past e^MAX_EXPONENT.

A chunk whose decay spans at most 2 MAX_EXPONENT in every channel (G_0d - G_{C-1,d}) factors every pair through the
channel's mid value R_d = (G_0d + G_{C-1,d}) / 2: P = tril((a e^{G - R}) (b e^{R - G})^T), one matmul, each factor
within e^{+-MAX_EXPONENT} (the pairs above the diagonal, up to e^{2 MAX_EXPONENT}, are dropped, never used).
A chunk decaying faster takes the sub-block path, which has no positive exponent at all (_sub_block_forward)."""
import torch

MAX_EXPONENT = 40.0  # e^40 ~ 2e17: a factor, times values and summed over a chunk, stays far below float32's 3e38


def _decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, block: int) -> torch.Tensor:
    """P_ij = sum_d a_id b_jd exp(G_id - G_jd) for i >= j, 0 above the diagonal; a, b, G [..., C, d_k], G the
    cumulative log decay (non-increasing in i). A chunk within the factored path's span (module docstring): one
    matmul. A chunk past it, with only non-positive exponents: cut into sub-blocks of `block` tokens (a divisor of C:
    chunk.sub_block), a pair in different sub-blocks factors through r, the first token of i's sub-block
    (j < r <= i), as (a_i exp(G_i - G_r)) . (b_j exp(G_r - G_j)), a matmul; a pair inside one sub-block takes
    exp(G_i - G_j) per channel (block (block - 1) / 2 d_k numbers per sub-block, the diagonal's being 1).
    Differentiated by _DecayedProducts's own backward, by the same split."""
    return _DecayedProducts.apply(a, b, G, block)


def _in_sub_blocks(x: torch.Tensor, c: int) -> list[torch.Tensor]:
    """Views of x [M, C, C] at its pairs inside one sub-block of c tokens (C = nb c), by offset: [M, nb, c - o] at
    (i, i - o), i and i - o in the same sub-block, for o = 0 .. c - 1."""
    M, C = x.shape[0], x.shape[-1]
    blocks = x.view(M, C // c, c, C // c, c).diagonal(dim1=1, dim2=3)  # [M, c, c, nb]: the sub-blocks on the diagonal
    return [blocks.diagonal(-o, dim1=1, dim2=2) for o in range(c)]


def _offset_starts(c: int) -> list[int]:
    """Where offset o (1 <= o < c) starts in the packed gamma, o = c the end; [0] at o = 0 (unused)."""
    return [0] + [(o - 1) * c - (o - 1) * o // 2 for o in range(1, c + 1)]


def _sub_block_forward(As, b, G, c: int):
    """The products P(a, b, G) of every a in As (sharing b and G: the decay factors are computed once), sub-blocks of
    c tokens, a, b, G [M, C, K]: ([P [M, C, C] per a], saved), saved the tensors _sub_block_backward takes. Only the
    kept pairs are
    computed: sub-block n's rows against the n c columns before it (one bmm each, b's factors exp(G_r - G_j) for j < r
    only), and the pairs inside a sub-block by offset o = i - j, gamma_o = exp(G_i - G_{i-o}) packed for o > 0 (the
    diagonal's is 1), never the masked rest of the grid."""
    M, C, K = G.shape
    nb = C // c
    As, b, G = [a.view(M, nb, c, K) for a in As], b.view(M, nb, c, K), G.view(M, nb, c, K)
    outs = [G.new_zeros(M, C, C) for _ in As]
    # across sub-blocks: the rows of sub-block n (r = n c, its first token) against every j < r, through r
    ref = G[:, :, :1]
    ea = torch.sub(G, ref).exp_()
    a_refs = [a * ea for a in As]
    b_flat, G_flat = b.view(M, C, K), G.view(M, C, K)
    cross = []
    for n in range(1, nb):
        eb = torch.sub(ref[:, n], G_flat[:, :n * c]).exp_()
        b_ref = eb * b_flat[:, :n * c]
        for out, a_ref in zip(outs, a_refs):
            # a fresh product, then copied: baddbmm_ into the strided view would loop matrix by matrix
            out[:, n * c:(n + 1) * c, :n * c] = torch.bmm(a_ref[:, n], b_ref.transpose(1, 2))
        cross += [eb, b_ref]
    # inside a sub-block, offset o > 0: gamma [M, nb, sum_o (c - o), K], offset o at rows starts[o]:starts[o + 1]
    starts = _offset_starts(c)
    gamma = G.new_empty(M, nb, starts[-1], K)
    for o in range(1, c):
        torch.sub(G[:, :, o:], G[:, :, :c - o], out=gamma[:, :, starts[o]:starts[o + 1]])
    gamma.exp_()
    bg = torch.empty_like(gamma)  # b_j gamma_ij, shared by every a
    for o in range(1, c):
        torch.mul(gamma[:, :, starts[o]:starts[o + 1]], b[:, :, :c - o], out=bg[:, :, starts[o]:starts[o + 1]])
    tmp = torch.empty_like(b)
    for a, out in zip(As, outs):
        pairs = _in_sub_blocks(out, c)
        pairs[0].copy_(torch.mul(a, b, out=tmp).sum(-1))
        for o in range(1, c):  # one sub-block's worth of a_i . b_j gamma_ij at a time (tmp stays in cache)
            t = torch.mul(a[:, :, o:], bg[:, :, starts[o]:starts[o + 1]], out=tmp[:, :, :c - o])
            pairs[o].copy_(t.sum(-1))
    return outs, (b, ea, gamma, bg, *As, *a_refs, *cross)


def _sub_block_backward(saved, dPs):
    """(da per a, db, dG), each [M, C, K], from _sub_block_forward's saved and dP [M, C, C] per a (only its lower
    triangle is read): da_i = sum_j dP_ij b_j exp(G_i - G_j), db_j = sum_i dP_ij a_i exp(G_i - G_j) by the
    forward's split (its saved factors: bmm across sub-blocks, gamma inside them), and dG = sum_a a da - b db (G_i
    enters with +, G_j with -); no exponent is positive in either direction."""
    b, ea, gamma, bg, *rest = saved
    As, a_refs, cross = rest[:len(dPs)], rest[len(dPs):2 * len(dPs)], rest[2 * len(dPs):]
    M, nb, c, K = b.shape
    C = nb * c
    starts = _offset_starts(c)
    db = torch.zeros_like(b)
    db_flat = db.view(M, C, K)
    das, in_blocks = [], []
    for a, a_ref, dP in zip(As, a_refs, dPs):
        pairs = [x[..., None] for x in _in_sub_blocks(dP, c)]
        da = b * pairs[0]
        db.addcmul_(a, pairs[0])
        for o in range(1, c):
            da[:, :, o:].addcmul_(bg[:, :, starts[o]:starts[o + 1]], pairs[o])
        for n in range(1, nb):
            eb, b_ref = cross[2 * n - 2:2 * n]
            dPn = dP[:, n * c:(n + 1) * c, :n * c]
            da[:, n].addcmul_(torch.bmm(dPn, b_ref), ea[:, n])
            db_flat[:, :n * c].addcmul_(torch.bmm(dPn.transpose(1, 2), a_ref[:, n]), eb)
        das.append(da)
        in_blocks.append(pairs)
    tmp = torch.empty_like(b)
    for o in range(1, c):  # db_j += gamma_ij sum_a dP_ij a_i, the a's summed before gamma weighs them
        x = torch.mul(As[0][:, :, o:], in_blocks[0][o], out=tmp[:, :, :c - o])
        for a, pairs in zip(As[1:], in_blocks[1:]):
            x.addcmul_(a[:, :, o:], pairs[o])
        db[:, :, :c - o].addcmul_(x, gamma[:, :, starts[o]:starts[o + 1]])
    dG = torch.mul(b, db).neg_()
    for a, da in zip(As, das):
        dG.addcmul_(a, da)
    return [da.view(M, C, K) for da in das], db_flat, dG.view(M, C, K)


def products_forward(As, b, G, c: int):
    """The products P(a, b, G) of every a in As (sharing b and G: the decay factors are computed once), a, b, G
    [..., C, K]: ([P [..., C, C] per a], saved), saved the tensors products_backward takes. The chunks within the
    factored path's span (module docstring) take one matmul per a; the others (`wide`) the sub-block path, of c
    tokens, their rows gathered and written over the matmul's."""
    shape = G.shape
    C, K = shape[-2:]
    As, b, G = ([x.reshape(-1, C, K) for x in As], b.reshape(-1, C, K), G.reshape(-1, C, K))  # contiguous
    M = G.shape[0]
    wide = ((G[:, 0] - G[:, -1]).amax(-1) > 2 * MAX_EXPONENT).nonzero()[:, 0]
    if len(wide) == M:
        outs, saved = _sub_block_forward(As, b, G, c)
        return [out.view(shape[:-1] + (C,)) for out in outs], (wide, *saved)
    ea = torch.sub(G, (G[:, :1] + G[:, -1:]) / 2).exp_()  # e^{G - R}
    eb = ea.reciprocal()  # e^{R - G}
    b_f = b * eb
    a_fs = [a * ea for a in As]
    outs = [torch.bmm(a_f, b_f.transpose(1, 2)).tril_() for a_f in a_fs]
    saved = (wide, ea, eb, b_f, *a_fs)
    if len(wide):
        exact, sub = _sub_block_forward([a[wide] for a in As], b[wide], G[wide], c)
        for out, x in zip(outs, exact):
            out.index_copy_(0, wide, x)
        saved += sub
    return [out.view(shape[:-1] + (C,)) for out in outs], saved


def products_backward(saved, dPs):
    """(da per a, db, dG), each [M, C, K], from products_forward's saved and dP per a (only dP's lower triangle is
    read): da_i = sum_j dP_ij b_j exp(G_i - G_j), db_j = sum_i dP_ij a_i exp(G_i - G_j) by the forward's split,
    and dG = sum_a a da - b db (G_i enters with +, G_j with -); R cancels out of P, so it takes no gradient."""
    wide, *saved = saved
    C = dPs[0].shape[-1]
    dPs = [dP.reshape(-1, C, C) for dP in dPs]
    if len(wide) == dPs[0].shape[0]:  # a sum's gradient comes expanded (stride 0): bmm would loop over it
        return _sub_block_backward(saved, [dP.contiguous() for dP in dPs])
    n = len(dPs)
    (ea, eb, b_f), a_fs, sub = saved[:3], saved[3:3 + n], saved[3 + n:]
    dPs = [dP.tril() for dP in dPs]
    d_afs = [torch.bmm(dP, b_f) for dP in dPs]
    d_bf = torch.bmm(dPs[0].transpose(1, 2), a_fs[0])
    for dP, a_f in zip(dPs[1:], a_fs[1:]):
        d_bf.baddbmm_(dP.transpose(1, 2), a_f)
    dG = torch.mul(d_bf, b_f).neg_()  # d(G - R) through e^{G - R} and e^{R - G}
    for d_af, a_f in zip(d_afs, a_fs):
        dG.addcmul_(d_af, a_f)
    das, db = [d_af.mul_(ea) for d_af in d_afs], d_bf.mul_(eb)
    if len(wide):
        exact = _sub_block_backward(sub, [dP[wide] for dP in dPs])
        for x, y in zip((*das, db, dG), (*exact[0], *exact[1:])):
            x.index_copy_(0, wide, y)
    return das, db, dG


class _DecayedProducts(torch.autograd.Function):
    """_decayed_products with a hand-written backward: products_forward and products_backward of one a."""

    @staticmethod
    def forward(ctx, a, b, G, block):
        (out,), saved = products_forward((a,), b, G, block)
        ctx.save_for_backward(*saved)
        ctx.shape = G.shape
        return out

    @staticmethod
    def backward(ctx, dP):
        (da,), db, dG = products_backward(ctx.saved_tensors, (dP,))
        return (*(x.view(ctx.shape) for x in (da, db, dG)), None)
