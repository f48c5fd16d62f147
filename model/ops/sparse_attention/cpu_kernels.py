"""CPU kernels (numba) for DSA: attention over selected keys and the lightning indexer. The selection
is idx [R, K] int32: for each of R query rows, K rows of the key tensors (-1 = empty slot, skipped).
Query heads come in groups of G = H / Hkv that share a key head (GQA); each kernel reads a selected
key row once per query and uses it for all G heads of its group, in one pass over the row's selection:

  logits          scale q[r, h] . k[idx[r, j], h // G], -inf in empty slots                (an SDDMM)
  softmax_grads   dS = P (dP - delta) scale, dP = do[r, h] . v[idx[r, j], h // G]         (an SDDMM)
  gathered_sum    sum_j c[r, h, j] b[idx[r, j], h // G]                                  (an SpMM)
  scattered_sum   its transpose: out[n, g] = sum over (r, j) selecting n of sum_{h in g} c a[r, h]
  index_scores    I = sum_h w_h relu(q_h . k) at the selection
  index_grads     its backward
  index_topk      the top-k keys of each query by I, given the q_i k_i^T block from a GEMM

torch.sparse's CSR kernels (MKL) run one head at a time and gather every key row once per head, and
the indexer's relu and head sum would be separate passes over [R, H_I, K] in torch ops; no library
does these on CPU, so they are written by hand. (Fusing the attention's softmax and its backward into
the products measured slower: numba's exp is scalar, and one pass through k, v, dk and dv rows at
once misses cache more than three passes through one each.) Loops run over query rows in parallel
(numba's prange, as many threads as torch uses); a kernel that scatters into key rows gives each
thread a contiguous block of query rows and its own output, summed at the end, so no two threads
write the same row. Inputs are contiguous float32 or float64, and the kernels accumulate in that dtype.
"""
import numba
import numpy as np
import torch
from numba import njit, prange

# fork-safe (a forked worker may call these after its parent did); the default OpenMP layer is not
numba.config.THREADING_LAYER = "workqueue"

_jit = njit(parallel=True, fastmath=True, cache=True)


@njit(fastmath=True, inline="always")
def _row_dots(a, b, idx, G, out):
    """out[h, j] = a[h] . b[idx[j], h // G] for one query row (0 in empty slots)."""
    H, D = a.shape
    K = idx.shape[0]
    K4 = K - K % 4
    zero = out.dtype.type(0)
    # four keys at a time: four independent accumulation chains per head
    for j in range(0, K4, 4):
        s0, s1, s2, s3 = max(idx[j], 0), max(idx[j + 1], 0), max(idx[j + 2], 0), max(idx[j + 3], 0)
        for h in range(H):
            g = h // G
            c0 = c1 = c2 = c3 = zero
            for d in range(D):
                x = a[h, d]
                c0 += x * b[s0, g, d]
                c1 += x * b[s1, g, d]
                c2 += x * b[s2, g, d]
                c3 += x * b[s3, g, d]
            out[h, j], out[h, j + 1], out[h, j + 2], out[h, j + 3] = c0, c1, c2, c3
    for j in range(K4, K):
        s = max(idx[j], 0)
        for h in range(H):
            c = zero
            for d in range(D):
                c += a[h, d] * b[s, h // G, d]
            out[h, j] = c
    for j in range(K):  # empty slots
        if idx[j] < 0:
            out[:, j] = 0


@_jit
def _logits(q, k, idx, scale, out):
    G = q.shape[1] // k.shape[1]
    for r in prange(q.shape[0]):
        _row_dots(q[r], k, idx[r], G, out[r])
        for j in range(idx.shape[1]):
            for h in range(q.shape[1]):
                out[r, h, j] = out[r, h, j] * scale if idx[r, j] >= 0 else -np.inf


@_jit
def _softmax_grads(do, v, p, delta, idx, scale, out):
    G = do.shape[1] // v.shape[1]
    for r in prange(do.shape[0]):
        _row_dots(do[r], v, idx[r], G, out[r])  # dP
        for h in range(do.shape[1]):
            for j in range(idx.shape[1]):
                out[r, h, j] = p[r, h, j] * (out[r, h, j] - delta[r, h]) * scale


@_jit
def _gathered_sum(c, b, idx, out):
    R, H, K = c.shape
    G = H // b.shape[1]
    for r in prange(R):
        out[r] = 0
        for j in range(K):
            s = idx[r, j]
            if s < 0:
                continue
            for h in range(H):
                w, g = c[r, h, j], h // G
                for d in range(out.shape[2]):
                    out[r, h, d] += w * b[s, g, d]


@_jit
def _index_scores(q, k, w, idx, dots, scores):
    R, H_I, K = dots.shape
    zero = dots.dtype.type(0)
    for r in prange(R):
        _row_dots(q[r], k, idx[r], H_I, dots[r])  # H_I heads share the one indexer key
        for j in range(K):
            if idx[r, j] < 0:
                scores[r, j] = -np.inf
                continue
            c = zero
            for h in range(H_I):
                c += w[r, h] * max(dots[r, h, j], zero)
            scores[r, j] = c


@_jit
def _scattered_sum(c, a, idx, out):
    R, H, K = c.shape
    P, _, Hkv, D = out.shape  # P partial outputs: one per block of query rows
    G = H // Hkv
    for part in prange(P):
        o = out[part]
        o[:] = 0
        r0, r1 = _row_block(part, P, R)
        for r in range(r0, r1):
            for j in range(K):
                s = idx[r, j]
                if s < 0:
                    continue
                for h in range(H):
                    w, g = c[r, h, j], h // G
                    for d in range(D):
                        o[s, g, d] += w * a[r, h, d]


@_jit
def _index_grads(grad, dots, q, k, w, idx, dq, dk, dw):
    R, H_I, K = dots.shape
    P, _, d_I = dk.shape  # P partial dk: one per block of query rows
    for part in prange(P):
        dk_p = dk[part]
        dk_p[:] = 0
        r0, r1 = _row_block(part, P, R)
        for r in range(r0, r1):
            dq[r] = 0
            dw[r] = 0
            for j in range(K):
                s, g = idx[r, j], grad[r, j]
                if s < 0:
                    continue
                for h in range(H_I):
                    x = dots[r, h, j]
                    if x > 0:  # d relu(x) = [x > 0]
                        dw[r, h] += x * g
                        c = g * w[r, h]
                        for d in range(d_I):
                            dq[r, h, d] += c * k[s, d]
                            dk_p[s, d] += c * q[r, h, d]


@njit(inline="always")
def _row_block(part, parts, rows):
    """Rows [start, stop) of block `part` of `parts` near-equal contiguous blocks of `rows` rows."""
    n = (rows + parts - 1) // parts
    return part * n, min(rows, (part + 1) * n)


def _threads() -> int:
    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().numpy()


def _parts(rows: int) -> int:
    """Blocks of query rows for the kernels that scatter into key rows or need scratch: one per thread."""
    return min(_threads(), max(1, rows))


def logits(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D], k [N, Hkv, D] -> [R, H, K]: scale q[r, h] . k[idx[r, j], h // G], -inf in empty slots."""
    out = q.new_empty(q.shape[0], q.shape[1], idx.shape[1])
    _threads()
    _logits(_np(q), _np(k), _np(idx), _np(q).dtype.type(scale), out.numpy())
    return out


def softmax_grads(do: torch.Tensor, v: torch.Tensor, p: torch.Tensor, delta: torch.Tensor, idx: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The gradient of softmax attention's q . k over the selection: dS = P (dP - delta) scale [R, H, K], with
    dP = do[r, h] . v[idx[r, j], h // G] (do [R, H, Dv], p [R, H, K], delta [R, H] = sum_j P dP)."""
    out = p.new_empty(p.shape)
    _threads()
    _softmax_grads(_np(do), _np(v), _np(p), _np(delta), _np(idx), _np(p).dtype.type(scale), out.numpy())
    return out


def gathered_sum(c: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out = c.new_empty(c.shape[0], c.shape[1], b.shape[2])
    _threads()
    _gathered_sum(_np(c), _np(b), _np(idx), out.numpy())
    return out


def index_scores(q, k, w, idx):
    """The lightning indexer at the selection: q [R, H_I, d], k [N, 1, d], w [R, H_I] ->
    dots [R, H_I, K] = q . k_sel, scores [R, K] = sum_h w_h relu(dots_h) (-inf in empty slots)."""
    dots, scores = q.new_empty(q.shape[0], q.shape[1], idx.shape[1]), q.new_empty(q.shape[0], idx.shape[1])
    _threads()
    _index_scores(_np(q), _np(k), _np(w), _np(idx), dots.numpy(), scores.numpy())
    return dots, scores


def scattered_sum(c: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, num_keys: int, kv_heads: int) -> torch.Tensor:
    parts = _parts(c.shape[0])
    out = c.new_empty(parts, num_keys, kv_heads, a.shape[2])
    _scattered_sum(_np(c), _np(a), _np(idx), out.numpy())
    return out[0] if parts == 1 else out.sum(0)


def index_grads(grad, dots, q, k, w, idx):
    """The backward of I[r, j] = sum_h w[r, h] relu(dots[r, h, j]), dots[r, h, j] = q[r, h] . k[idx[r, j]]:
    grad [R, K] (ignored in empty slots), dots [R, H_I, K], q [R, H_I, d], k [N, d], w [R, H_I] ->
    dq [R, H_I, d], dk [N, d], dw [R, H_I]."""
    parts = _parts(dots.shape[0])
    dq, dw, dk = q.new_empty(q.shape), w.new_empty(w.shape), k.new_empty(parts, *k.shape)
    _index_grads(_np(grad), _np(dots), _np(q), _np(k), _np(w), _np(idx), dq.numpy(), dk.numpy(), dw.numpy())
    return dq, dk.sum(0), dw


@njit(fastmath=True, cache=True)
def _largest_first(vals, pos, n, k):
    """Reorder vals[:n] (and pos[:n] alike) in place so that the first k hold the k largest: quickselect
    with Hoare partitions around a median-of-three pivot (ties may fall either side)."""
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        x, y, z = vals[lo], vals[mid], vals[hi]
        pivot = max(min(x, y), min(max(x, y), z))
        i, j = lo, hi
        while i <= j:
            while vals[i] > pivot:
                i += 1
            while vals[j] < pivot:
                j -= 1
            if i <= j:
                vals[i], vals[j] = vals[j], vals[i]
                pos[i], pos[j] = pos[j], pos[i]
                i += 1
                j -= 1
        if k - 1 <= j:  # [lo, j] >= pivot >= [i, hi]
            hi = j
        elif k - 1 >= i:
            lo = i
        else:
            return


@_jit
def _index_topk(dots, w, lo, hi, out, parts):
    n, H_I, S = dots.shape
    K = out.shape[1]
    zero = dots.dtype.type(0)
    for part in prange(parts):  # one block of rows per thread, with its scratch allocated once
        scores, vals = np.empty(S, dots.dtype), np.empty(S, dots.dtype)
        keys, chunk = np.empty(S, np.int32), np.empty(S, np.int32)
        i0, i1 = _row_block(part, parts, n)
        for i in range(i0, i1):
            a, L = lo[i], hi[i] - lo[i] + 1  # visible keys a .. hi[i]
            if L <= K:
                for j in range(K):
                    out[i, j] = a + j if j < L else -1
                continue
            # I = sum_h w_h relu(dots_h) over the visible keys; the last head's pass also takes the
            # maxima of C > K chunks. The K-th largest chunk maximum tau is <= the K-th largest score
            # (K distinct entries reach it), so the top K lie among the entries >= tau.
            sc = scores[:L]
            C = L // max(1, L // (2 * K))
            sc[:] = 0
            for h in range(H_I - 1):
                dh, wh = dots[i, h, a:a + L], w[i, h]
                for s in range(L):
                    sc[s] += wh * max(dh[s], zero)
            dh, wh = dots[i, H_I - 1, a:a + L], w[i, H_I - 1]
            maxima = vals[:C]
            maxima[:] = -np.inf
            for r in range(L // C):  # chunk c = {c, C + c, 2 C + c, ...}: elementwise maxima of rows
                row, d_row = sc[r * C:(r + 1) * C], dh[r * C:(r + 1) * C]
                for c in range(C):
                    x = row[c] + wh * max(d_row[c], zero)
                    row[c] = x
                    maxima[c] = max(maxima[c], x)
            for s in range(L // C * C, L):
                sc[s] += wh * max(dh[s], zero)
            _largest_first(maxima, chunk, C, K)
            tau = maxima[0]
            for c in range(1, K):
                tau = min(tau, maxima[c])
            m = 0
            for s in range(L):  # the candidates (>= K of them), branch-free
                x = sc[s]
                vals[m], keys[m] = x, s
                m += x >= tau
            _largest_first(vals, keys, m, K)
            for j in range(K):
                out[i, j] = a + keys[j]


def index_topk(dots: torch.Tensor, w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int) -> torch.Tensor:
    """For a block of n queries: dots [n, H_I, S] = q_i . k_i per indexer head, w [n, H_I]; query i sees
    keys lo[i] .. hi[i]. Returns [n, k] int64: the positions of its k highest scores
    I = sum_h w_h relu(dots_h) among them (in no order; ties broken arbitrarily), all of them and -1
    beyond when it sees <= k."""
    out = torch.empty(dots.shape[0], k, dtype=torch.long)
    _index_topk(_np(dots), _np(w), _np(lo), _np(hi), out.numpy(), _parts(dots.shape[0]))
    return out
