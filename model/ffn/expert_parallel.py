"""Expert parallelism (EP) for one MoE layer: its routed experts split over the processes of a group,
each token's rows sent to the process that holds its expert and back (torchtitan's and Megatron's
token dispatch, on torch.distributed's autograd-aware all-to-all).

Of N processes, rank r holds experts [r L, (r + 1) L), L = E / N. A forward, given its assignments
already sorted by expert (MoE.forward), with counts c [E] of rows per expert:
  1. sizes: all-gather the counts, C [N, E] (every rank then knows what each rank sends and receives);
  2. dispatch: one all-to-all of the rows, rank r sending sum_{e of rank s} c_e rows to rank s;
  3. the local experts run on the rows received, regrouped by local expert;
  4. combine: the reverse all-to-all returns each output row to the rank and slot it came from.
The router, the gates and the shared experts stay on each rank (replicated); so does everything else.
Autograd runs the two all-to-alls in reverse in backward. Training glue (the device mesh, the gradient
reduction over data replicas, checkpoints): training/parallel.py.
"""
import time

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single


class Stopwatch(torch.autograd.Function):
    """Identity that adds the seconds between two of its calls, in forward and again in backward, to
    stats[key]: placed on both sides of a collective, it times the collective both ways."""

    @staticmethod
    def forward(ctx, x, stats: dict, key: str, start: bool):
        ctx.stats, ctx.key, ctx.start = stats, key, start
        mark(stats, key, start)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        mark(ctx.stats, ctx.key, not ctx.start)  # backward meets the pair in the reverse order
        return grad, None, None, None


def mark(stats: dict, key: str, start: bool) -> None:
    now = time.perf_counter()
    if start:
        stats[f"_{key}_t0"] = now
    else:
        stats[key] = stats.get(key, 0.0) + now - stats.pop(f"_{key}_t0")


class ExpertParallel:
    """One MoE layer's share of the experts and the exchange of rows with the other ranks of `group`.
    `stats` accumulates over training forwards (grad enabled) until read (training/parallel.py):
    all-to-all seconds (forward and backward), bytes sent by this rank (dispatch and combine, forward
    and backward), rows sent, and the received-rows imbalance across ranks (max / mean) summed over
    forwards, with their count."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.local = num_experts, num_experts // self.size
        self.stats: dict = {}

    @property
    def experts(self) -> slice:
        """The global indices of this rank's experts."""
        return slice(self.rank * self.local, (self.rank + 1) * self.local)

    def run(self, xs: torch.Tensor, counts: torch.Tensor, local_experts) -> torch.Tensor:
        """xs [S, d]: this rank's rows sorted by (global) expert, counts [E] rows per expert;
        local_experts(rows [R, d], counts [L]) -> [R, d] runs this rank's experts on rows sorted by
        local expert. Returns the experts' outputs for xs's rows, in xs's order."""
        N, L = self.size, self.local
        every = counts.new_empty(N * self.num_experts)
        dist.all_gather_single(every, counts.contiguous(), group=self.group)
        every = every.view(N, self.num_experts)
        send = counts.view(N, L).sum(1).tolist()        # rows to each rank
        from_each = every[:, self.experts]                # [N sources, L]: rows each rank sends here, per local expert
        recv = from_each.sum(1).tolist()

        timed = torch.is_grad_enabled()                  # training forwards (and their backward), not evaluation
        received = self.exchange(xs, recv, send, timed)  # grouped by source rank, then by local expert
        local_expert = torch.repeat_interleave(torch.arange(L, device=xs.device).repeat(N), from_each.flatten())
        order = local_expert.argsort(stable=True)
        out = local_experts(received[order], from_each.sum(0))
        out = torch.empty_like(out).index_copy(0, order, out)  # back to the order received
        ys = self.exchange(out, send, recv, timed)
        if not timed:
            return ys
        with torch.no_grad():
            loads = every.view(N, N, L).sum((0, 2)).float()  # rows each rank receives
            row_bytes = xs.shape[1] * xs.element_size()
            self.add("rows_sent", float(sum(send)))
            self.add("bytes", 2.0 * (sum(send) + sum(recv)) * row_bytes)  # dispatch + combine, forward + backward
            self.add("received_imbalance", (loads.max() / loads.mean().clamp_min(1e-9)).item())
            self.add("forwards", 1.0)
        return ys

    def exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int], timed: bool) -> torch.Tensor:
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        if timed:
            x = Stopwatch.apply(x, self.stats, "seconds", True)
        out = all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=self.group)
        return Stopwatch.apply(out, self.stats, "seconds", False) if timed else out

    def add(self, key: str, value: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + value
