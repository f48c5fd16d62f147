"""Context parallelism's exchanges: what travels between the ranks that share the sequences of a batch.

A context group of P ranks splits every row of a batch [B, T] into P contiguous slices of L = T / P tokens:
rank r holds tokens [r L, (r + 1) L) of every row. The slices are contiguous, not the load-balanced order
(r, 2P - 1 - r) that causal softmax alone would prefer: a recurrent mixer passes its state from each slice to the
next, and in a hybrid every layer reads the same residual stream, so one order must serve every layer
(docs/distributed.md#context-parallelism). Each mixer's context-parallel form sits beside its op
(model/ops/<op>/context_parallel.py, model/mixers/softmax.py, dsa.py) and exchanges only what its math needs, through these
methods, each differentiable (its backward is the reverse exchange), so the training loop's backward needs
no special code:

    gather(x)                 every rank's x, [P, *x.shape]: keys and values (softmax), indexer keys (DSA)
    shift(x)                  the previous rank's x, zeros on rank 0: a short convolution's kernel - 1 halo tokens
    incoming(A, B, apply)     the state entering this rank's slice, composing every earlier slice's affine
                              state map S -> apply(A_s, S) + B_s in order (the recurrent mixers)
    fetch(x, rows)            chosen rows of the other ranks' x (DSA: only the keys and values its top-k picked)
    total(x)                  x summed over the group: the loss and the MoE's balance statistics of whole sequences

Every rank calls every exchange, in the same order, and uses its result (rank 0 too, multiplied by zero where
it has no predecessor): a rank that left a result unused would skip its part of the backward's collective and
leave the others waiting. `sent` counts the bytes each kind of exchange sent from this rank, forward and
backward, since it was last read (training logs it per step as cp/bytes).
"""
import torch
import torch.distributed as dist


class ContextGroup:
    """This rank's place in a context-parallel group: rank `rank` of `size` over the process group `group`."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.sent: dict[str, float] = {}

    def bounds(self, length: int) -> tuple[int, int]:
        """The tokens [start, end) of a row of `length` that this rank holds."""
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split into {self.size} context-parallel slices; "
                             f"valid: a multiple of trainer.context_parallel={self.size}")
        part = length // self.size
        return self.rank * part, (self.rank + 1) * part

    def count(self, kind: str, x: torch.Tensor, copies: float = 1.0) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + copies * x.numel() * x.element_size()

    def take_sent(self) -> dict[str, float]:
        """The bytes sent since the last call, by kind of exchange; then the count restarts."""
        sent, self.sent = self.sent, {}
        return sent

    # the exchanges -----------------------------------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[P, *x.shape]: every rank's x (all-gather; backward: reduce-scatter of the gradients)."""
        return _Gather.apply(x, self)

    def gather_sequence(self, x: torch.Tensor, end: int) -> torch.Tensor:
        """x [B, L, *] of every rank concatenated along time, its first `end` tokens: [B, end, *]."""
        every = self.gather(x)  # [P, B, L, *]
        return every.transpose(0, 1).flatten(1, 2)[:, :end]

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """The previous rank's x (same shape), zeros on rank 0 (each rank sends x to the next, the last to
        rank 0, which multiplies it by zero: the exchange is cyclic so that every rank takes part)."""
        received = _Shift.apply(x, self)
        return received * 0 if self.rank == 0 else received

    def incoming(self, transition: torch.Tensor, offset: torch.Tensor, apply) -> torch.Tensor:
        """The state entering this rank's slice when each slice s maps its incoming state S to
        apply(A_s, S) + B_s (A_s = `transition`, B_s = `offset` on rank s) and rank 0 starts from zero:
        S_r = B_{r-1} + apply(A_{r-1}, B_{r-2} + apply(A_{r-2}, ...)). One all-gather of (A, B), then the
        composition over the earlier ranks here; the backward returns each rank its gradients."""
        packed = torch.cat([transition.reshape(-1), offset.reshape(-1).to(transition.dtype)])
        every = self.gather(packed)  # [P, |A| + |B|]
        A = every[:, :transition.numel()].view(self.size, *transition.shape)
        B = every[:, transition.numel():].view(self.size, *offset.shape)
        if self.rank == 0:
            return B[0] * 0  # used, so that rank 0 joins the backward's reduce-scatter
        state = B[0]
        for s in range(1, self.rank):
            state = apply(A[s], state) + B[s]
        return state

    def fetch(self, x: torch.Tensor, wanted: list[torch.Tensor]) -> torch.Tensor:
        """x [n, *]: this rank's rows. wanted[s]: the indices of the rows of rank s that this rank needs (its own
        entry unused). Returns those rows, rank by rank in order, [sum_s len(wanted[s]), *]: the requests travel
        by one all-to-all of counts and one of indices, the rows by a third (backward: their gradients return)."""
        wanted = [w if s != self.rank else w[:0] for s, w in enumerate(wanted)]
        asks = torch.tensor([len(w) for w in wanted], dtype=torch.long, device=x.device)
        asked = torch.empty_like(asks)
        dist.all_to_all_single(asked, asks, group=self.group)  # asked[s]: rows rank s wants from here
        requests = torch.cat(wanted).to(device=x.device, dtype=torch.long)
        received = requests.new_empty(int(asked.sum()))
        dist.all_to_all_single(received, requests, asked.tolist(), asks.tolist(), group=self.group)
        self.count("fetch", requests)
        rows = x.index_select(0, received)
        return _Exchange.apply(rows, asks.tolist(), asked.tolist(), self)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group (all-reduce; its backward sums the gradients the same way)."""
        return _Total.apply(x, self)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        out = x.new_empty(cp.size * x.numel())
        dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=cp.group)
        cp.count("gather", x, cp.size - 1)
        return out.view(cp.size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out.view(-1), grad.contiguous().view(-1), group=cp.group)
        cp.count("gather", out, cp.size - 1)
        return out, None


class _Shift(torch.autograd.Function):
    """x to rank r + 1 (mod P), rank r - 1's x back; backward the reverse."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _shifted(x, cp, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shifted(grad, ctx.cp, -1), None


def _shifted(x: torch.Tensor, cp: ContextGroup, step: int) -> torch.Tensor:
    """x sent to rank r + step and the x of rank r - step received (mod P), by one all-to-all."""
    to, source = (cp.rank + step) % cp.size, (cp.rank - step) % cp.size
    send = [int(d == to) for d in range(cp.size)]
    receive = [int(s == source) for s in range(cp.size)]
    flat = x.contiguous().view(1, -1)
    out = flat.new_empty(1, flat.shape[1])
    dist.all_to_all_single(out, flat, receive, send, group=cp.group)
    cp.count("shift", x)
    return out.view_as(x)


class _Exchange(torch.autograd.Function):
    """rows [n, *] sent in `send` counts to the ranks in order, `receive` counts received from each (an
    all-to-all of rows); backward sends the gradients of the received rows back."""

    @staticmethod
    def forward(ctx, rows, receive, send, cp):
        ctx.cp, ctx.receive, ctx.send = cp, receive, send
        return _all_to_all_rows(rows, receive, send, cp)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.send, ctx.receive, ctx.cp), None, None, None


def _all_to_all_rows(rows: torch.Tensor, receive: list[int], send: list[int], cp: ContextGroup) -> torch.Tensor:
    out = rows.new_empty(sum(receive), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=cp.group)
    cp.count("fetch", rows)
    return out


class _Total(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=cp.group)
        cp.count("total", x, 2 * (cp.size - 1) / cp.size)  # a ring all-reduce's share per rank
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Total.apply(grad, ctx.cp), None
