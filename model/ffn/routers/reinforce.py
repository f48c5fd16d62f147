"""Routing learnt by reinforcement (RL-R of Clark et al. 2022, "Unified Scaling Laws for Routed
Language Models", arXiv:2202.01169; policy-gradient routing as Bengio et al. 2015, arXiv:1511.06297,
and Rosenbaum et al. 2018, arXiv:1711.01239): the router is a policy that samples each token's k
experts at training, and is trained by REINFORCE on the token's LM loss.

    pi_t = softmax((x_t W_r^T + b) / tau)           the policy; b: the MoE's aux-free bias (a logit shift),
                                                    tau: the sampling temperature at this step
    training: e_1..e_k ~ pi_t without replacement   Gumbel-top-k on log pi_t (Plackett-Luce order)
        policy=ordered: log pi(e) = sum_j log softmax(z_t masked at e_1..e_{j-1})[e_j]
        policy=set:     log pi({e}) = log of the sum of that over the k! orders of the set
    evaluation, decoding: e = topk(x_t W_r^T + b)   greedy, deterministic (tau does not change it)
    r_t = -CE_t                                     the token's own next-token loss, detached
    A_t = (r_t - b_t - mean_s(r_s - b_s)) / std_s(r_s - b_s)    standardised over the forward's labelled tokens, per layer
    L_pg = coef mean_t -A_t log pi(e_t)             over the tokens with a label
    L_ent = -entropy_coef mean_t H(pi_t)            (an entropy bonus)
    gates: route_scale softmax(x_t W_r^T)_i of the sampled experts [/ their sum if norm_topk_prob]

The score-function and entropy terms train the policy only: log pi is computed from the router's input
detached, x_t.detach() W_r^T (policy_grad_to_input=false), so the trunk below the router learns from the LM
loss (the gate term included) and not from the per-token policy gradient, whose variance is the
per-token reward's; policy_grad_to_input=true lets it through x as well.

Reward assignment: every layer's router gets the same per-token reward, the final LM loss of that
token's prediction: each training forward subscribes on the aux channel (`aux.on_token_loss`), which
`DecoderLM.forward` serves once it knows each token's loss; a layer is credited for the whole model's
loss at that token, as in Clark et al. The gates carry the policy's probabilities, so the LM loss
also reaches the router through them as with top-k (norm_topk_prob with k = 1 leaves REINFORCE the
only signal). The score-function term weighs 1 (loss_coef) against the gate term, as the unbiased
gradient of the expected loss does.

Baselines b_t (baseline), each independent of the token's sampled experts:
    token_table    b_t = a moving average of the reward of the tokens with t's input id: per id v,
                   m_v <- decay m_v + (1 - decay) (mean reward of v's tokens in the optimizer step),
                   bias-corrected by its own update count n_v, m_v / (1 - decay^n_v) (as Adam's moments;
                   summed over ranks); an id not seen yet: the forward's mean reward
    self_critical  b_t = -CE_t of the same batch through the model in evaluation mode, routed greedily
                   (one extra forward without grad; Rennie et al. 2017, arXiv:1612.00563)
    mean           b_t = the forward's mean reward (any scalar baseline: the standardisation centres A)
    value          b_t = mean + v . x_t, v [d] a learnt linear value head on the detached router input,
                   zero at init, trained by L_v = mean_t (r_t - b_t)^2 (only v sees it)

The temperature anneals geometrically over the first temperature_steps optimizer steps,
tau(s) = start (end / start)^min(s / steps, 1) (an exponential schedule, as Jang et al. 2017's
Gumbel-softmax temperature, arXiv:1611.01144). Two pulls towards a flat policy are off unless asked
for: the router weight takes no weight decay (weight_decay=false; training/optim.py, no_weight_decay)
and the MoE's z-loss does not reach its logits (z_loss=false; they set the policy's sharpness).

Sampling is seeded per token, not by the global RNG: the Gumbel noise of (token, expert) is a hash
of the layer, the optimizer step and the token's context (a polynomial hash of its row's ids up to
it), so which experts a token samples does not depend on how the batch is split over processes or
micro-batches.
"""
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import initialization as init

from model.ffn.routers.routing import Routing, ScoredRouter, TokenChoiceGateOptions
from model.options import bad_option, option
from model.registry import ROUTERS

BASELINES = ("token_table", "self_critical", "mean", "value")
POLICIES = ("ordered", "set")
STD_FLOOR = 1e-8  # the standardisation's A / (std + floor): 0 where every advantage is equal
MASK32 = 0xFFFFFFFF
PRIME = 1_000_003  # the context hash: sum_s id_s PRIME^s mod 2^31 - 1
MODULUS = 2**31 - 1


@dataclass
class ReinforceOptions(TokenChoiceGateOptions):
    loss_coef: float = option(1.0, at_least=0)          # coef of L_pg
    entropy_coef: float = option(0.0, at_least=0)       # entropy bonus
    baseline: str = option("token_table", choices=BASELINES)
    baseline_decay: float = option(0.99, at_least=0)    # < 1: the token table's moving averages
    policy: str = option("ordered", choices=POLICIES)   # log pi of the ordered draw, or of its set
    temperature_start: float = option(1.0, above=0)     # tau at step 0
    temperature_end: float = option(0.25, above=0)      # tau from temperature_steps on
    temperature_steps: int = option(120, at_least=0)    # optimizer steps of the anneal (0: end throughout)
    weight_decay: bool = option(False)                  # the router weight takes the optimizer's weight decay
    z_loss: bool = option(False)                        # the MoE's z-loss (z_loss_coef) applies to the logits
    policy_grad_to_input: bool = option(False)          # L_pg and L_ent reach the router's input x (the trunk)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def context_keys(token_ids: torch.Tensor, token_rows: torch.Tensor | None = None) -> torch.Tensor:
    """token ids [B, T] (or [T]) -> an int64 key [B T] per token: the hash of its row's ids up to it; or with
    token_rows [N] (non-decreasing: each token's row, as a padded batch's real tokens), ids [N] hashed within their
    rows."""
    if token_rows is None:
        ids = token_ids.reshape(-1, token_ids.shape[-1]).long()
        token_rows = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
    ids = token_ids.reshape(-1).long()
    row_start = torch.searchsorted(token_rows, token_rows)  # the index of each token's row's first token
    powers = torch.tensor(prime_powers(ids.numel()), device=ids.device)[torch.arange(ids.numel(), device=ids.device)
                                                                         - row_start]
    # each term < 2^31 (ids < 2^31, powers < 2^31, products reduced), so the cumsums stay exact in int64
    terms = (ids % MODULUS) * powers % MODULUS
    sums = terms.cumsum(0)
    return (sums - sums[row_start] + terms[row_start]) % MODULUS


@functools.cache
def prime_powers(length: int) -> tuple[int, ...]:
    """PRIME^t mod MODULUS for t < length."""
    return tuple(pow(PRIME, t, MODULUS) for t in range(length))


def gumbel_noise(keys: torch.Tensor, num_experts: int, salt) -> torch.Tensor:
    """Standard Gumbel noise [N, E], a fixed function of (key, expert, salt); salt an int or an int64
    scalar tensor (the router's step count stays on its device: no sync per forward)."""
    h = fmix32((keys & MASK32) ^ (salt * 0x9E3779B9 & MASK32))
    h = fmix32(h[:, None] ^ (torch.arange(num_experts, device=keys.device) * 0x7FEB352D & MASK32))
    u = (h.double() + 0.5) / 2**32
    return -torch.log(-torch.log(u))


def sample_log_prob(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """log pi of the ordered draw without replacement experts [N, k] from softmax(logits [N, E]):
    sum over slots j of log softmax(logits, the experts of slots < j removed)[e_j]."""
    total = logits.new_zeros(logits.shape[0])
    removed = torch.zeros_like(logits, dtype=torch.bool)
    for j in range(experts.shape[1]):
        e = experts[:, j : j + 1]
        total = total + logits.masked_fill(removed, float("-inf")).log_softmax(-1).gather(-1, e)[:, 0]
        removed = removed.scatter(1, e, True)
    return total


def set_log_prob(log_policy: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """log pi of the set {e_1..e_k} (any order) drawn without replacement from softmax(log_policy [N, E]):
    the log of the sum over its k! orders of the Plackett-Luce probability, by a sum over subsets,
    f(A) = sum_{a in A} f(A without a) p_a / (1 - p(A without a)), f({}) = 1, in log space (2^k k terms)."""
    N, k = experts.shape
    log_policy = log_policy.log_softmax(-1)
    log_p = log_policy.gather(-1, experts)                      # [N, k]
    log_rest = [log_policy.logsumexp(-1)]                       # log(1 - p(B)) per proper subset B (a bitmask)
    for mask in range(1, 2**k - 1):
        removed = experts[:, [j for j in range(k) if mask >> j & 1]]
        log_rest.append(log_policy.scatter(1, removed, float("-inf")).logsumexp(-1))
    f = [log_p.new_zeros(N)]
    for mask in range(1, 2**k):
        terms = [f[mask ^ 1 << j] + log_p[:, j] - log_rest[mask ^ 1 << j] for j in range(k) if mask >> j & 1]
        f.append(torch.stack(terms, -1).logsumexp(-1))
    return f[-1]


def standardized(advantage: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + STD_FLOOR), mean and std (population) over the labelled tokens."""
    n = labelled.sum().clamp_min(1)
    mean = (advantage * labelled).sum() / n
    std = ((((advantage - mean) ** 2) * labelled).sum() / n).sqrt()
    return (advantage - mean) / (std + STD_FLOOR)


@dataclass
class PolicyStep:
    """What one training forward of a REINFORCE router keeps until the token losses arrive."""
    log_prob: torch.Tensor          # [N] log pi of each token's sampled experts (with grad)
    log_policy: torch.Tensor        # [N, E] log pi (with grad): the entropy
    resampled: torch.Tensor         # [N] bool: the sampled experts differ (as a set) from greedy's
    value: torch.Tensor | None      # [N] v . x_t (baseline=value)
    token_ids: torch.Tensor         # [N] the input ids (baseline=token_table)
    temperature: torch.Tensor       # tau of this forward


@ROUTERS.register("reinforce")
class Reinforce(ScoredRouter):
    Options = ReinforceOptions
    takes_selection_bias = True
    context_parallel = False  # its loss takes each token's LM loss over the forward's tokens, not reduced over slices

    def __init__(self, config, layer_idx: int, moe):
        super().__init__(config, layer_idx, moe)  # layer_idx: part of the sampling salt
        o = self.options
        self.decay = o.baseline_decay
        if not self.decay < 1:
            raise bad_option(f"{moe.router} router", "baseline_decay", self.decay, "0 <= decay < 1")
        if o.temperature_steps == 0 and o.temperature_start != o.temperature_end:
            raise bad_option(f"{moe.router} router", "temperature_steps", 0,
                             f"> 0 to anneal temperature_start={o.temperature_start} to temperature_end={o.temperature_end}")
        self.takes_z_loss = o.z_loss
        # Optimizer steps taken (the sampling salt and the temperature's step). Persistent, as the token
        # table: a resumed run samples and subtracts as the uninterrupted one.
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        if o.baseline == "token_table":  # per input id: the moving average m_v and its update count n_v
            self.register_buffer("reward_table", torch.zeros(config.vocab_size, dtype=torch.float64))
            self.register_buffer("table_updates", torch.zeros(config.vocab_size, dtype=torch.long))
        self.value = nn.Parameter(torch.zeros(config.hidden_size)) if o.baseline == "value" else None
        self.pending_reward: torch.Tensor | None = None  # [2, V]: per id, this step's reward sum and count
        self.pending_step = False  # a training forward since the last optimizer step

    def init_parameters(self) -> None:
        """The weight (ScoredRouter's), the value head 0, and the buffers 0: a checkpoint without them (another
        baseline's) starts them afresh."""
        super().init_parameters()
        for tensor in (self.value, self.steps, getattr(self, "reward_table", None), getattr(self, "table_updates", None)):
            if tensor is not None:
                init.zeros_(tensor)

    def no_weight_decay(self) -> tuple[str, ...]:
        """The parameters the optimizer does not decay (training/optim.py declared_undecayed)."""
        return () if self.options.weight_decay else ("weight",)

    def flops_per_token(self) -> float:
        """Forward FLOPs of a training step's routing: the logits x W_r^T, again from the detached input for the
        policy unless policy_grad_to_input, and the value head's v . x (baseline=value). Evaluation and decoding
        run the first matmul only; a step is what budgets and MFU count."""
        d, E = self.in_features, self.num_experts
        again = 0 if self.options.policy_grad_to_input else 2 * d * E
        return 2 * d * E + again + (2 * d if self.value is not None else 0)

    @property
    def needs_eval_forward(self) -> bool:
        """baseline=self_critical: each training forward also runs the whole model once in evaluation mode
        (DecoderLM.eval_forwards_per_step)."""
        return self.options.baseline == "self_critical"

    def temperature(self) -> torch.Tensor:
        """tau at this optimizer step: start (end / start)^min(step / temperature_steps, 1)."""
        o = self.options
        progress = (self.steps.double() / o.temperature_steps).clamp(max=1) if o.temperature_steps else 1.0
        return torch.as_tensor(o.temperature_start * (o.temperature_end / o.temperature_start) ** progress,
                               dtype=torch.float64, device=self.steps.device)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None, token_rows: torch.Tensor | None = None) -> Routing:
        """With aux (a training forward), the router's loss waits for each token's LM loss (aux.on_token_loss)."""
        logits = self.logits(x)
        scores = logits.softmax(-1)
        shift = (lambda z: z) if selection_bias is None else (lambda z: z + selection_bias.to(z.dtype))
        greedy = shift(logits.detach()).topk(self.top_k, dim=-1).indices
        if not self.training:
            return Routing.from_token_choice(greedy, self.token_choice_gates(scores, greedy), logits=logits, probs=scores)
        # the same values; without policy_grad_to_input, L_pg and L_ent reach W_r but not x
        policy_logits = shift(logits if self.options.policy_grad_to_input else self.logits(x.detach()))
        if token_ids is None or token_ids.numel() != x.shape[0]:
            raise ValueError("router=reinforce needs the input token ids of the forward's tokens (its sampling is seeded by them)")
        temperature = self.temperature()
        log_policy = (policy_logits / temperature).log_softmax(-1)
        noise = gumbel_noise(context_keys(token_ids, token_rows), self.num_experts, salt=self.steps * 1024 + self.layer_idx)
        experts = (log_policy.detach().double() + noise).topk(self.top_k, dim=-1).indices
        # which of greedy's k experts the draw also made: its share is token_choice_overlap (the MoE logs it)
        agrees = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, experts, True).gather(1, greedy)
        if aux is not None:
            log_prob = (set_log_prob if self.options.policy == "set" else sample_log_prob)(log_policy, experts)
            value = x.detach().to(self.value.dtype) @ self.value if self.value is not None else None
            policy = PolicyStep(log_prob, log_policy, ~agrees.all(-1), value, token_ids.reshape(-1), temperature)
            aux.on_token_loss(functools.partial(self.reinforce, policy=policy),
                              with_eval_loss=self.options.baseline == "self_critical")
            self.pending_step = True
        return Routing.from_token_choice(experts, self.token_choice_gates(scores, experts), logits=logits, probs=scores,
                                         token_choice_overlap=agrees.float().mean())

    def baseline(self, reward: torch.Tensor, mean_reward: torch.Tensor, eval_loss: torch.Tensor | None,
                 policy: PolicyStep) -> torch.Tensor:
        """b_t [N] of the chosen baseline (detached, but for the value head's term)."""
        kind = self.options.baseline
        if kind == "self_critical":
            return -eval_loss.to(reward.dtype)
        if kind == "token_table":
            updates = self.table_updates[policy.token_ids]
            average = self.reward_table[policy.token_ids] / (1 - self.decay ** updates.double())
            return torch.where(updates > 0, average.to(reward.dtype), mean_reward)  # 0 / 0 where not taken
        base = mean_reward.expand_as(reward)
        return base + policy.value if kind == "value" else base

    def reinforce(self, aux, token_loss: torch.Tensor, labelled: torch.Tensor, eval_loss: torch.Tensor | None, *,
                  policy: PolicyStep) -> None:
        """Add this forward's REINFORCE losses and telemetry, given each token's LM loss [N] (detached; the
        reward r_t = -loss), whether it has a label [N] bool (the rewards of the others are not used) and,
        for the self-critical baseline, its loss under the evaluation forward [N]."""
        reward = -token_loss.to(policy.log_prob.dtype)
        tag = f"moe/layer{self.layer_idx}"
        n = labelled.sum().clamp_min(1)
        mean_reward = (reward * labelled).sum() / n
        base = self.baseline(reward, mean_reward, eval_loss, policy)
        if policy.value is not None:
            aux.add_loss("moe/reinforce_value_loss", (((reward - base) ** 2) * labelled).sum() / n, 1.0)
        advantage = (reward - base).detach()
        score = standardized(advantage, labelled)
        aux.add_loss("moe/reinforce_loss", -(score * policy.log_prob * labelled).sum() / n, self.options.loss_coef)
        entropy = -(policy.log_policy.exp() * policy.log_policy).sum(-1)
        aux.add_loss("moe/policy_entropy", (entropy * labelled).sum() / n, -self.options.entropy_coef)
        with torch.no_grad():
            mean_advantage = (advantage * labelled).sum() / n
            metrics = {
                "reward": mean_reward,
                "baseline": (base * labelled).sum() / n,
                "advantage_var": (((advantage - mean_advantage) ** 2) * labelled).sum() / n,  # before standardising
                "resampled_frac": (policy.resampled & labelled).sum() / n,
                "temperature": policy.temperature,
            }
            for name, value in metrics.items():
                aux.add_metric(f"moe/{name}", value)
                aux.add_metric(f"{tag}/{name}", value)
            aux.add_metric(f"{tag}/policy_entropy", (entropy * labelled).sum() / n)  # moe/policy_entropy: the loss's log
            if self.options.baseline == "token_table":
                pending = reward.new_zeros(2, self.reward_table.numel(), dtype=torch.float64)
                pending[0].index_add_(0, policy.token_ids, (reward * labelled).double())
                pending[1].index_add_(0, policy.token_ids, labelled.double())
                self.pending_reward = pending if self.pending_reward is None else self.pending_reward + pending

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The step count moves on; each id's moving average takes this step's mean reward of its tokens
        over every process's forwards (ids without a labelled token keep theirs)."""
        if not self.pending_step:
            return
        if self.pending_reward is not None:
            total = self.pending_reward
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(total)
            seen = total[1] > 0
            updated = self.decay * self.reward_table + (1 - self.decay) * total[0] / total[1].clamp_min(1)
            self.reward_table.copy_(torch.where(seen, updated, self.reward_table))
            self.table_updates += seen
        self.steps += 1
        self.pending_reward, self.pending_step = None, False
