"""PPO's arithmetic on one batch of rollouts (plain tensors, no model): per-token rewards with the KL
penalty, masked whitening, generalised advantage estimation, the clipped policy and value losses, and
the adaptive KL coefficient. Every per-token tensor is [rows, s] and aligned with the completion mask of
`megatron_patch.rlhf.rollout.batch_of` (position t holds the log-probability of the token at t + 1 and the
critic's value of the prefix ending at t). The conventions are those of Ziegler et al. (2019) and TRL's
PPO trainer."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance, + 1e-8); `shift_mean=False` keeps the
    mean (reward whitening rescales rewards without moving them). Unmasked entries come back as 0."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def sequence_kl(logps: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows] KL(policy || reference) of each completion, estimated from its sampled tokens: the sum of
    log p - log p_ref over them."""
    return ((logps - ref) * mask).sum(-1)


def token_rewards(scores: torch.Tensor, logps: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -kl_coef x (log p - log p_ref) at every completion token, plus the completion's
    score (reward model or rule) at its last token."""
    rewards = -kl_coef * (logps - ref) * mask
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
    rewards[torch.arange(len(scores), device=mask.device), last] += scores.to(rewards.dtype)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """(advantages, returns) by generalised advantage estimation over each row's completion tokens:
    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0), A_t = delta_t + gamma lam A_{t+1};
    returns = A + V. Zero outside the mask."""
    rows, s = rewards.shape
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rows, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(s)):
        following = mask[:, t + 1] if t + 1 < s else torch.zeros_like(running)
        next_value = values[:, t + 1] * following if t + 1 < s else following
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * following) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def policy_loss(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: float):
    """(clipped surrogate loss, clip fraction): mean over completion tokens of
    max(-A ratio, -A clip(ratio, 1 - clip, 1 + clip)), ratio = p / p_old; the fraction of tokens where the
    clipped term is the larger."""
    ratio = torch.exp(logps - old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, float(masked_mean((clipped > unclipped).float(), mask))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float):
    """(clipped value loss, value clip fraction): 0.5 x mean over completion tokens of
    max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)."""
    change = values - old_values
    # exactly `values` where the clip does not bind (old + (values - old) may round differently)
    clipped = torch.where(change.abs() > clip, old_values + torch.clamp(change, -clip, clip), values)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, float(masked_mean((clipped_loss > unclipped_loss).float(), mask))


class KLController:
    """The KL coefficient: fixed, or adaptive (Ziegler et al. 2019) when `target` is set: after each
    batch of `n` rollouts whose mean KL is `kl`, coef *= 1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.target is None:
            return
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n / self.horizon
