"""Routing learnt by reinforcement (RL-R of Clark et al. 2022, "Unified Scaling Laws for Routed
Language Models", arXiv:2202.01169; policy-gradient routing as Bengio et al. 2015, arXiv:1511.06297,
and Rosenbaum et al. 2018, arXiv:1711.01239): the router is a policy that samples each token's k
experts at training, and is trained by REINFORCE on the token's LM loss.

    pi_t = softmax(x_t W_r^T + b)                   the policy; b: the MoE's aux-free bias (a logit shift)
    training: e_1..e_k ~ pi_t without replacement   Gumbel-top-k on log pi_t (Plackett-Luce order)
        log pi(e_1..e_k) = sum_j log softmax(z_t masked at e_1..e_{j-1})[e_j]
    evaluation, decoding: e = topk(pi_t)            greedy, deterministic
    r_t = -CE_t                                     the token's own next-token loss, detached
    L_pg = coef mean_t -(r_t - b_t) log pi(e_t)      over the tokens with a label
    L_ent = -entropy_coef mean_t H(pi_t)            (an entropy bonus)
    gates: route_scale pi_{t,i} of the sampled experts [/ their sum if norm_topk_prob]

Reward assignment: every layer's router gets the same per-token reward, the final LM loss of that
token's prediction: each training forward subscribes on the aux channel (`aux.on_token_loss`), which
`DecoderLM.forward` serves once it knows each token's loss; a layer is credited for the whole model's
loss at that token, as in Clark et al. The gates carry the policy's probabilities, so the LM loss
also reaches the router through them as with top-k (norm_topk_prob with k = 1 leaves REINFORCE the
only signal).

Options: loss_coef, entropy_coef, baseline, baseline_decay, norm_topk_prob, route_scale (the policy is
a softmax over all experts: no score_func, no group limit).

Baselines (baseline):
    mean   b_t = an exponential moving average of the mean reward per optimizer step (decay
           baseline_decay, bias-corrected as Adam's moments; summed over ranks, so every
           process holds the same); before the first update, the forward's own mean reward
    value  b_t = mean + v . x_t, v [d] a learnt linear value head on the detached router input,
           zero at init, trained by L_v = mean_t (r_t - b_t)^2 (only v sees it)

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

BASELINES = ("mean", "value")
MASK32 = 0xFFFFFFFF
PRIME = 1_000_003  # the context hash: sum_s id_s PRIME^s mod 2^31 - 1
MODULUS = 2**31 - 1


@dataclass
class ReinforceOptions(TokenChoiceGateOptions):
    loss_coef: float = option(1e-2, at_least=0)        # coef of L_pg
    entropy_coef: float = option(0.0, at_least=0)      # entropy bonus
    baseline: str = option("mean", choices=BASELINES)
    baseline_decay: float = option(0.99, at_least=0)  # < 1


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def context_keys(token_ids: torch.Tensor) -> torch.Tensor:
    """token ids [B, T] (or [T]) -> an int64 key [B T] per token: the hash of its row's ids up to it."""
    ids = token_ids.reshape(-1, token_ids.shape[-1]).long()
    powers = torch.tensor(prime_powers(ids.shape[1]), device=ids.device)
    # each term < 2^31 (ids < 2^31, powers < 2^31, products reduced), so the cumsum stays exact in int64
    return ((ids % MODULUS) * powers % MODULUS).cumsum(-1).flatten() % MODULUS


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


@dataclass
class PolicyStep:
    """What one training forward of a REINFORCE router keeps until the token losses arrive."""
    log_prob: torch.Tensor          # [N] log pi of each token's sampled experts (with grad)
    log_policy: torch.Tensor        # [N, E] log pi (with grad): the entropy
    resampled: torch.Tensor         # [N] bool: the sampled experts differ (as a set) from greedy's
    value: torch.Tensor | None      # [N] v . x_t (baseline=value)


@ROUTERS.register("reinforce")
class Reinforce(ScoredRouter):
    Options = ReinforceOptions
    takes_selection_bias = True

    def __init__(self, config, layer_idx: int, moe):
        super().__init__(config, layer_idx, moe)  # layer_idx: part of the sampling salt
        self.decay = self.options.baseline_decay
        if not self.decay < 1:
            raise bad_option(f"{moe.router} router", "baseline_decay", self.decay, "0 <= decay < 1")
        # The bias-corrected moving average: m <- decay m + (1 - decay) mean reward, steps updates;
        # the baseline is m / (1 - decay^steps). Persistent: a resumed run samples and subtracts as before.
        self.register_buffer("reward_average", torch.zeros((), dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.value = nn.Parameter(torch.zeros(config.hidden_size)) if self.options.baseline == "value" else None
        self.pending_reward: torch.Tensor | None = None  # (sum, count) of this optimizer step's rewards

    def init_parameters(self) -> None:
        super().init_parameters()
        if self.value is not None:
            init.zeros_(self.value)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None) -> Routing:
        """With aux (a training forward), the router's loss waits for each token's LM loss (aux.on_token_loss)."""
        logits = self.logits(x)
        scores = logits.softmax(-1)
        policy_logits = logits if selection_bias is None else logits + selection_bias.to(logits.dtype)
        greedy = policy_logits.detach().topk(self.top_k, dim=-1).indices
        if not self.training:
            return Routing.from_token_choice(greedy, self.token_choice_gates(scores, greedy), logits=logits, probs=scores)
        if token_ids is None or token_ids.numel() != x.shape[0]:
            raise ValueError("router=reinforce needs the input token ids of the forward's tokens (its sampling is seeded by them)")
        log_policy = policy_logits.log_softmax(-1)
        noise = gumbel_noise(context_keys(token_ids), self.num_experts, salt=self.steps * 1024 + self.layer_idx)
        experts = (log_policy.detach().double() + noise).topk(self.top_k, dim=-1).indices
        if aux is not None:
            resampled = (experts.sort(-1).values != greedy.sort(-1).values).any(-1)
            value = x.detach().to(self.value.dtype) @ self.value if self.value is not None else None
            policy = PolicyStep(sample_log_prob(policy_logits, experts), log_policy, resampled, value)
            aux.on_token_loss(functools.partial(self.reinforce, policy=policy))
        return Routing.from_token_choice(experts, self.token_choice_gates(scores, experts), logits=logits, probs=scores)

    def reinforce(self, aux, token_loss: torch.Tensor, labelled: torch.Tensor, *, policy: PolicyStep) -> None:
        """Add this forward's REINFORCE losses and telemetry, given each token's LM loss [N] (detached; the
        reward r_t = -loss) and whether it has a label [N] bool (the rewards of the others are not used)."""
        reward = -token_loss.to(policy.log_prob.dtype)
        tag = f"moe/layer{self.layer_idx}"
        n = labelled.sum().clamp_min(1)
        mean_reward = (reward * labelled).sum() / n
        # the moving average once it has an update, else the forward's own mean (torch.where: no sync per layer)
        average = self.reward_average / (1 - self.decay ** self.steps.double())
        base = torch.where(self.steps > 0, average.to(reward.dtype), mean_reward.detach())
        if policy.value is not None:
            base = base + policy.value
            aux.add_loss("moe/reinforce_value_loss", (((reward - base) ** 2) * labelled).sum() / n, 1.0)
        advantage = (reward - base).detach()
        aux.add_loss("moe/reinforce_loss", -(advantage * policy.log_prob * labelled).sum() / n, self.options.loss_coef)
        entropy = -(policy.log_policy.exp() * policy.log_policy).sum(-1)
        aux.add_loss("moe/policy_entropy", (entropy * labelled).sum() / n, -self.options.entropy_coef)
        with torch.no_grad():
            mean_advantage = (advantage * labelled).sum() / n
            metrics = {
                "reward": mean_reward,
                "baseline": (base * labelled).sum() / n if base.ndim else base,
                "advantage_var": (((advantage - mean_advantage) ** 2) * labelled).sum() / n,
                "resampled_frac": (policy.resampled & labelled).sum() / n,
            }
            for name, value in metrics.items():
                aux.add_metric(f"moe/{name}", value)
                aux.add_metric(f"{tag}/{name}", value)
            aux.add_metric(f"{tag}/policy_entropy", (entropy * labelled).sum() / n)  # moe/policy_entropy: the loss's log
            pending = torch.stack([(reward * labelled).sum().double(), labelled.sum().double()])
            self.pending_reward = pending if self.pending_reward is None else self.pending_reward + pending

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The moving average takes this step's mean reward over every process's forwards."""
        if self.pending_reward is None:
            return
        total = self.pending_reward
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        if total[1] > 0:
            self.reward_average.mul_(self.decay).add_((1 - self.decay) * total[0] / total[1])
            self.steps += 1
        self.pending_reward = None
