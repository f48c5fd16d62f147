"""DSA's selection as sparse matrices (the layouts: model/ops/sparse_attention): `Selection` prepares a layer
call's `indices` for the ops restricted to the selected keys, through the numba kernels of cpu_kernels.py on CPU
and torch.sparse's CSR (cuSPARSE) elsewhere."""
import functools
import warnings

import torch
import torch.nn.functional as F

from model.ops.sparse_attention import cpu_kernels


class Selection:
    """`indices` [B, T, K] over S keys, prepared once per layer call for the ops restricted to the
    selected keys, over query rows r = b T + t and key rows n = b S + s, with G = H / Hkv query heads per
    key head: `logits` (scale q[r, h] . k[n_rj, h // G], an SDDMM), `gathered_sum` (an SpMM) and
    `scattered_sum` (its transpose), softmax `attention` over the selected keys and its backward
    `attention_grads` from them, and the indexer's `index_scores` with `index_grads`.
    backend "numba" (the default on CPU): the kernels of cpu_kernels.py on `key_rows` ([B T, K] key
    rows, -1 = empty), which read each selected key row once for a whole head group.
    "csr" (the default elsewhere: cuSPARSE): torch.sparse, one head at a time, through the CSR [B T, B S]
    of the selection and, built on first use, the CSR of its transpose, with the elementwise steps in
    torch ops. Both hold the selected entries only (empty slots left out), each row's columns sorted and
    distinct, as cuSPARSE's CSR routines assume; `slots` maps the entries to the [B T, K] slots."""

    BACKENDS = ("numba", "csr")

    def __init__(self, indices: torch.Tensor, num_keys: int, backend: str | None = None):
        B, T, K = indices.shape
        self.backend = backend or ("numba" if _numba_runs(indices.device) else "csr")
        if self.backend not in self.BACKENDS:
            raise ValueError(f"Selection backend {self.backend!r}: choose one of {self.BACKENDS}")
        if self.backend == "numba" and indices.device.type != "cpu":
            raise ValueError(f"Selection backend 'numba' runs on CPU tensors only, not {indices.device.type}")
        self.indices, self.num_keys = indices, num_keys
        self.valid = indices >= 0
        # int32 positions where they fit: the sparse kernels (numba, MKL, cuSPARSE) then index with
        # 32-bit numbers, and torch.sparse would otherwise convert both index arrays on every call
        fits = max(B * T * K, B * num_keys) < 2**31
        self.index_dtype = torch.int32 if fits else torch.long
        base = torch.arange(B, device=indices.device).view(B, 1, 1) * num_keys
        if self.backend == "numba":
            self.key_rows = (indices + base).masked_fill(~self.valid, -1).view(B * T, K).to(self.index_dtype)
        else:  # each row's keys in ascending order, the empty slots (sent past the last key) dropped
            cols, order = (indices + base).masked_fill(~self.valid, B * num_keys).view(B * T, K).sort(-1)
            kept = cols < B * num_keys
            self.col = cols[kept].to(self.index_dtype)
            self.crow = F.pad(kept.sum(-1).cumsum(0), (1, 0)).to(self.index_dtype)
            # slots[i]: the flat slot r K + j of the i-th entry (values [B T, K] -> entries and back)
            self.slots = (order + torch.arange(0, B * T * K, K, device=indices.device)[:, None])[kept]

    @property
    def rows(self) -> int:
        return self.indices.shape[0] * self.indices.shape[1]

    @property
    def col_count(self) -> int:
        return self.indices.shape[0] * self.num_keys

    def logits(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B T, H, D], k [B S, Hkv, D] -> [B T, H, K]: scale q[r, h] . k[n_rj, h // G], -inf in empty
        slots (an SDDMM)."""
        if self.backend == "numba":
            return cpu_kernels.logits(q, k, self.key_rows, scale)
        return self._dots(q, k).mul_(scale).masked_fill_(~self.valid.view(self.rows, 1, -1), float("-inf"))

    def gathered_sum(self, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """c [B T, H, K], b [B S, Hkv, D] -> [B T, H, D]: sum_j c[r, h, j] b[n_rj, h // G] (an SpMM)."""
        if self.backend == "numba":
            return cpu_kernels.gathered_sum(c, b, self.key_rows)
        G = c.shape[1] // b.shape[1]
        return torch.stack([self.matrix(c[:, h]) @ b[:, h // G] for h in range(c.shape[1])], 1)

    def attention(self, q, k, v, scale: float):
        """(p [B T, H, K], o [B T, H, Dv], probs [B T, K]): p = softmax over the selected keys of scale
        dots(q, k) (0 in empty slots), o = gathered_sum(p, v), probs = p averaged over heads."""
        p = self.logits(q, k, scale).softmax(-1)
        return p, self.gathered_sum(p, v), p.mean(1)

    def scattered_sum(self, c: torch.Tensor, a: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """c [B T, H, K], a [B T, H, D] -> [B S, Hkv, D]: the transpose of gathered_sum (an SpMM^T)."""
        if self.backend == "numba":
            return cpu_kernels.scattered_sum(c, a, self.key_rows, self.col_count, kv_heads)
        G = c.shape[1] // kv_heads
        return torch.stack([sum(self.matrix_t(c[:, h]) @ a[:, h] for h in range(g * G, (g + 1) * G))
                            for g in range(kv_heads)], 1)

    def attention_grads(self, do, o, p, q, k, v, scale: float):
        """The backward of `attention` given do [B T, H, Dv]: (dq, dk, dv)."""
        delta = (do * o).sum(-1)  # [B T, H]: sum_j p_j dp_j
        if self.backend == "numba":
            ds = cpu_kernels.softmax_grads(do, v, p, delta, self.key_rows, scale)
        else:  # softmax backward, times d(logit)/d(q.k)
            ds = p * (self._dots(do, v) - delta[:, :, None]) * scale
        Hkv = k.shape[1]
        return self.gathered_sum(ds, k), self.scattered_sum(ds, q, Hkv), self.scattered_sum(p, do, Hkv)

    def index_scores(self, q, k, w):
        """The indexer at the selection, q [B T, H_I, d], k [B S, 1, d], w [B T, H_I]: (dots [B T, H_I, K],
        I = sum_h w_h relu(dots_h) [B T, K], -inf in empty slots)."""
        if self.backend == "numba":
            return cpu_kernels.index_scores(q, k, w, self.key_rows)
        dots = self._dots(q, k)
        return dots, (dots.relu() * w[:, :, None]).sum(1).masked_fill_(~self.valid.view(self.rows, -1), float("-inf"))

    def index_grads(self, grad, dots, q, k, w):
        """The backward of `index_scores` (k given as [B S, d]) given grad [B T, K]: (dq, dk, dw)."""
        if self.backend == "numba":
            return cpu_kernels.index_grads(grad, dots, q, k, w, self.key_rows)
        g = grad[:, None].masked_fill(~self.valid.view(self.rows, 1, -1), 0)
        ddots = g * w[:, :, None] * (dots > 0)  # d relu(x) = [x > 0]
        return self.gathered_sum(ddots, k[:, None]), self.scattered_sum(ddots, q, 1)[:, 0], (dots.relu() * g).sum(-1)

    # ---- the csr backend

    def _dots(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [B T, H, D], b [B S, Hkv, D] -> [B T, H, K]: a[r, h] . b[n_rj, h // G], 0 in empty slots."""
        G = a.shape[1] // b.shape[1]
        return torch.stack([self._sampled_dots(a[:, h].contiguous(), b[:, h // G].contiguous())
                            for h in range(a.shape[1])], 1)

    @functools.cached_property
    def _transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(crow, col, slots) of the transpose [B S, B T]: the entries by key (a stable sort keeps each
        key's query rows ascending, as the CSR's rows are); slots as `slots`, in this order."""
        keys = self.col.long()
        order = keys.sort(stable=True).indices
        slots = self.slots.index_select(0, order)
        query = (slots // self.indices.shape[2]).to(self.index_dtype)
        crow = torch.zeros(self.col_count + 1, dtype=self.index_dtype, device=keys.device)
        crow[1:] = torch.bincount(keys, minlength=self.col_count).cumsum(0)
        return crow, query, slots

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        """CSR [B T, B S] with `values` [B T, K] at the selected entries (empty slots dropped)."""
        return _csr(self.crow, self.col, values.reshape(-1).index_select(0, self.slots), (self.rows, self.col_count))

    def matrix_t(self, values: torch.Tensor) -> torch.Tensor:
        """CSR [B S, B T]: the transpose of matrix(values)."""
        crow, col, slots = self._transposed
        return _csr(crow, col, values.reshape(-1).index_select(0, slots), (self.col_count, self.rows))

    def _sampled_dots(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [B T, D], b [B S, D] -> [B T, K]: a[row] . b[col] at each selected entry (one head), 0 in
        empty slots."""
        out = _csr(self.crow, self.col, a.new_zeros(self.col.numel()), (self.rows, self.col_count))
        torch.sparse.sampled_addmm(out, a, b.t(), beta=0.0, out=out)  # in place: no copy of the structure
        return a.new_zeros(self.indices.numel()).index_copy_(0, self.slots, out.values()).view(self.rows, -1)


def _csr(crow, col, values, size) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that CSR support is in beta
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _numba_runs(device: torch.device) -> bool:
    """Whether the numba kernels (cpu_kernels.py) serve tensors on this device: CPU only."""
    return device.type == "cpu"


def _as_selection(indices, num_keys: int) -> Selection:
    return indices if isinstance(indices, Selection) else Selection(indices, num_keys)


def _rows(x: torch.Tensor, acc) -> torch.Tensor:
    """[B, S, H, D] -> [B S, H, D] in acc dtype, contiguous: the kernels' layout."""
    return x.to(acc).reshape(-1, *x.shape[2:]).contiguous()
