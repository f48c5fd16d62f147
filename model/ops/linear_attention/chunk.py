"""Causal linear attention's chunked form, and the scalar-decay chunked core it shares with the SSD op (the op
and its layouts: model/ops/linear_attention). On CUDA tensors, when fla imports, the unnormalised part runs in
fla's kernel; the normaliser (which fla's `normalize` does not carry across calls) is always ours."""
import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, kernel_runs, optional_kernel, own_precision
from model.ops.varlen import ChunkLayout, check_packed, sequence_cumsum


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., n] -> [..., n, n] with entry (i, j) = sum_{j < m <= i} a_m for i >= j, -inf above the
    diagonal; built by masked cumsums (no difference of large prefix sums)."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)  # x[..., i, j] = a_i
    x = x.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1), 0)
    x = x.cumsum(-2)
    return x.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def chunk_scalar_decay(q, k, v, g, scale: float, chunk_size: int, initial_state=None, cu_seqlens=None):
    """o_t = scale * S_t^T q_t with S_t = exp(g_t) S_{t-1} + k_t v_t^T, per value head.

    q, k [B, T, G, K] (G groups, each shared by H / G consecutive value heads), v [B, T, H, V],
    g [B, T, H] log-decay (<= 0) or None (no decay), state [B, H, K, V]. Inputs are already in the
    compute dtype. Returns o [B, T, H, V], final state [B, H, K, V].

    Chunks of C = min(chunk_size, T) tokens (T padded with k = v = g = 0, which leaves the state
    unchanged); within a chunk with cumulative log-decay G_l:
      o_l = scale (sum_{s <= l} (q_l . k_s) exp(G_l - G_s) v_s + exp(G_l) q_l^T S_start)
      S_end = exp(G_C) S_start + sum_s exp(G_C - G_s) k_s v_s^T
    and the chunk-start states of all chunks at once through the chunk-level decay matrix.
    With cu_seqlens (batch 1) each sequence is laid out on whole chunks, the decay matrix keeps only
    entries within one sequence and a sequence's first chunk starts from zero; the final state is
    then [N, H, K, V], one per sequence.
    """
    Bsz, T, H, V = v.shape
    G, K = q.shape[2], q.shape[3]
    C = min(chunk_size, T)
    layout = None
    if cu_seqlens is not None:
        check_packed(q, cu_seqlens, initial_state)
        layout = ChunkLayout.build(cu_seqlens, C)
        q, k, v = layout.pad(q), layout.pad(k), layout.pad(v)
        g = None if g is None else layout.pad(g)
        T = layout.length
    pad = (-T) % C
    n = (T + pad) // C

    def chunks(t):  # [B, T, X, D] -> [B, X, n, C, D]
        t = F.pad(t, (0, 0, 0, 0, 0, pad))
        return t.view(Bsz, n, C, t.shape[2], t.shape[3]).permute(0, 3, 1, 2, 4)

    q, k = chunks(q).unsqueeze(2), chunks(k).unsqueeze(2)  # [B, G, 1, n, C, K]
    v = chunks(v).reshape(Bsz, G, H // G, n, C, V)  # [B, G, H/G, n, C, V]
    if g is None:
        g = v.new_zeros(Bsz, G, H // G, n, C)
    else:
        g = F.pad(g, (0, 0, 0, pad)).view(Bsz, n, C, G, H // G).permute(0, 3, 4, 1, 2)
    gc = g.cumsum(-1)  # G_l, [B, G, H/G, n, C]
    g_last = gc[..., -1:]

    # Intra-chunk: causal (q k^T) o exp(G_l - G_s), one q k^T per group.
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    o = ((q @ k.transpose(-1, -2)) * decay) @ v

    # Each chunk's own contribution to its end state: sum_s exp(G_C - G_s) k_s v_s^T.
    states = (k * (g_last - gc).exp()[..., None]).transpose(-1, -2) @ v  # [B, G, H/G, n, K, V]
    if initial_state is None:
        initial_state = v.new_zeros(Bsz, H, K, V)
    states = torch.cat([initial_state.view(Bsz, G, H // G, 1, K, V), states], dim=3)
    # Start state of chunk i (i = 0..n, n = final): sum_{j <= i} exp(g_last_j + ... + g_last_{i-1}) states_j.
    chunk_decay = _segsum(F.pad(g_last[..., 0], (1, 0))).exp()  # [B, G, H/G, n+1, n+1]
    if layout is not None:  # row / column m stands for the state after chunk m - 1 (m = 0: chunk 0's start)
        seq = layout.resets.cumsum(0)  # the sequence of each chunk
        seq = torch.cat([seq[:1], seq])
        chunk_decay = chunk_decay * (seq[:, None] == seq[None, :])
    states = (chunk_decay @ states.flatten(-2)).view(Bsz, G, H // G, n + 1, K, V)
    start, final = states[..., :-1, :, :], states[..., -1, :, :]
    if layout is not None:
        start = start.masked_fill(layout.resets.view(n, 1, 1), 0.0)
        final = states[0, :, :, layout.ends].permute(2, 0, 1, 3, 4)  # [N, G, H/G, K, V]

    o = o + (q * gc.exp()[..., None]) @ start
    o = (scale * o).reshape(Bsz, H, n * C, V).transpose(1, 2)[:, :T]
    if layout is not None:
        return layout.unpad(o), final.reshape(-1, H, K, V)
    return o, final.reshape(Bsz, H, K, V)


FLA_CHUNK_SIZE = 64  # the chunk of fla's chunk_simple_gla, which chunk_linear_attn and the SSD's kernel call run


def chunk_flops_per_token(seq_len: int, chunk_size: int, groups: int, heads: int, k_dim: int, v_dim: int,
                          sequential_states: bool = False) -> float:
    """Forward FLOPs per token of the chunked scalar-decay form at chunk C = chunk_size, the sequence padded to
    n = ceil(seq_len / C) whole chunks (2 per multiply-add). Per chunk: q k^T per group (C^2 K), and per head
    scores @ v (C^2 V), the chunk's own end state k^T v and q S_start (C K V each). Then the chunk-start states:
    all at once through the (n+1) x (n+1) chunk-decay matmul ((n+1)^2 K V per head: chunk_scalar_decay), or with
    sequential_states one chunk after another, S <- exp(g) S + dS (2 K V FLOPs per head per chunk: fla's kernels)."""
    C = chunk_size
    n = -(-seq_len // C)
    per_chunk = 2 * C * C * k_dim * groups + heads * 2 * (C * C * v_dim + 2 * C * k_dim * v_dim)
    passing = heads * 2 * k_dim * v_dim * (n if sequential_states else (n + 1) ** 2)
    return (n * per_chunk + passing) / seq_len


def chunk_linear_attn_flops(seq_len: int, heads: int, k_dim: int, v_dim: int, chunk_size: int, device) -> float:
    """Forward FLOPs per token of chunk_linear_attn on `device` (k, v repeated to the H heads): fla's kernel at
    its chunk with sequential states where it runs (CUDA), else chunk_scalar_decay at min(chunk_size, seq_len).
    The normaliser (O(K) per token, not a matmul) is not counted."""
    if kernel_runs("fla.ops.linear_attn", device):
        return chunk_flops_per_token(seq_len, FLA_CHUNK_SIZE, heads, heads, k_dim, v_dim, sequential_states=True)
    return chunk_flops_per_token(seq_len, min(chunk_size, seq_len), heads, heads, k_dim, v_dim)


@own_precision
def chunk_linear_attn(q, k, v, scale: float | None = None, initial_state=None,
                      output_final_state: bool = False, normalize: bool = False,
                      chunk_size: int = 64, eps: float = 1e-6, cu_seqlens=None):
    """Causal linear attention (model/ops/linear_attention). scale defaults to K^-0.5.

    Without normalize, initial_state / final state are S [B, H, K, V]; with normalize they are pairs
    (S, z) with z [B, H, K] the running sum of keys. Returns (o [B, T, H, V] in v's dtype,
    final state or None)."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S0 = z0 = None
    if initial_state is not None:
        S0, z0 = initial_state if normalize else (initial_state, None)
    kernel = optional_kernel("fla.ops.linear_attn", "chunk_linear_attn", q)
    if kernel is not None:
        o, S = kernel(q, k, v, scale=scale, initial_state=S0, output_final_state=output_final_state,
                      normalize=False, cu_seqlens=cu_seqlens)
        o = o.to(accumulation_dtype(v.dtype))
    else:
        ct = accumulation_dtype(v.dtype)
        o, S = chunk_scalar_decay(q.to(ct), k.to(ct), v.to(ct), None, scale, chunk_size,
                                  None if S0 is None else S0.to(ct), cu_seqlens)
    final = S if output_final_state else None
    if normalize:
        ct = o.dtype
        if cu_seqlens is None:
            kc = k.to(ct).cumsum(1)  # z_t = z0 + sum_{i <= t} k_i
        else:
            check_packed(q, cu_seqlens, z0)
            kc = sequence_cumsum(k.to(ct), cu_seqlens)
        if z0 is not None:
            kc = kc + z0.to(ct)[:, None]
        o = o / ((scale * q.to(ct) * kc).sum(-1, keepdim=True) + eps)
        z = kc[:, -1] if cu_seqlens is None else kc[0, cu_seqlens[1:] - 1]
        final = (S, z) if output_final_state else None
    return o.to(v.dtype), final
