"""Critic-free advantage estimators and the DAPO batch filters.

Group-relative advantages (GRPO / RLOO / Dr. GRPO): every prompt is sampled ``G`` times and
each reward is compared with its own group. For sample ``i`` of a group ``g`` of size ``n``::

    b_i = mean_g(r)                          (default baseline)
    b_i = (sum_g(r) - r_i) / (n - 1)         (leave-one-out baseline, RLOO)
    A_i = r_i - b_i                          (normalize_rewards=False, Dr. GRPO)
    A_i = (r_i - b_i) / (std_g(r) + eps)     (normalize_rewards=True, GRPO)

``std_g`` is the UNBIASED sample standard deviation (Bessel's correction, divisor ``n - 1``,
like ``torch.std``) of the whole group, ``r_i`` included, and ``eps = 1e-6`` by default.

A group whose rewards are all equal, and a group of a single sample, carries no signal: its
advantages are exactly 0 (never NaN or inf), decided by an exact ``max == min`` test rather
than by a floating-point mean that may not reproduce the rewards exactly.

REINFORCE++ (:func:`reinforce_plus_plus_advantages`) is token-level: with the outcome score
``s_i`` (``r_i``, or ``r_i - mean_g(r)`` for the ``-baseline`` variant), per valid token ``t``
(the generated tokens, in order; other positions are skipped and get 0)::

    r_it = -beta * KL_it + (s_i if t is the sample's last valid token else 0)
    G_it = sum_{u >= t, u valid} gamma^(number of valid tokens from t to u, exclusive) * r_iu
    A_it = (G_it - mean(G)) / (std(G) + 1e-8)

where mean and std (population, divisor N) run over every valid token of the WHOLE batch
passed in (the driver passes a step's full rollout batch, before it is split over ranks and
micro batches). A batch whose valid returns are all equal gets 0 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "discounted_returns",
    "gae_advantages",
    "group_mean_baseline",
    "group_relative_advantages",
    "has_reward_variance",
    "outcome_token_rewards",
    "overlong_sample_mask",
    "reinforce_plus_plus_advantages",
    "soft_overlong_penalty",
    "whiten",
]

REINFORCE_PP_EPS = 1e-8
"""Added to the global std of the REINFORCE++ returns before dividing (OpenRLHF's value)."""


def _group_index(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | None
) -> tuple[torch.Tensor, int]:
    """Flattened ``[N]`` dense group index (0..num_groups-1) and the number of groups."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(
                "rewards must be [num_prompts, G] when no group_ids are given; got shape "
                f"{tuple(rewards.shape)}"
            )
        num_groups, size = rewards.shape
        index = torch.arange(num_groups, device=rewards.device).repeat_interleave(size)
        return index, num_groups
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] with group_ids; got shape {tuple(rewards.shape)}")
    ids = torch.as_tensor(group_ids, device=rewards.device)
    if ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(ids.shape)} and rewards {tuple(rewards.shape)} differ")
    unique, index = torch.unique(ids, return_inverse=True)
    return index, unique.numel()


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, values
    )


def _zero_variance(flat: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-sample flag: its group has a single sample or all-equal rewards (exact test)."""
    empty = torch.empty(num_groups, dtype=flat.dtype, device=flat.device)
    group_max = empty.scatter_reduce(0, index, flat, "amax", include_self=False)
    group_min = empty.scatter_reduce(0, index, flat, "amin", include_self=False)
    return (group_max == group_min)[index]


def group_relative_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    use_leave_one_out_baseline: bool = True,
    normalize_rewards: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages relative to each sample's group (see the module docstring).

    Args:
        rewards: ``[num_prompts, G]`` (one row per group), or ``[N]`` together with
            ``group_ids``.
        group_ids: ``[N]`` group label of each sample (any integers; groups may differ in size).
        use_leave_one_out_baseline: baseline = mean of the group's OTHER rewards (RLOO)
            instead of the group mean; default True like ``grpo.use_leave_one_out_baseline``.
        normalize_rewards: divide by the group's unbiased std plus ``eps``; default True like
            ``grpo.normalize_rewards``.
        eps: added to the std, so near-constant groups cannot blow up.

    Returns:
        Advantages with the shape and dtype of ``rewards`` (computed in float64); exactly 0
        for zero-variance and single-sample groups.
    """
    index, num_groups = _group_index(rewards, group_ids)
    flat = rewards.reshape(-1).to(torch.float64)

    count = _group_sum(torch.ones_like(flat), index, num_groups)[index]
    total = _group_sum(flat, index, num_groups)[index]
    mean = total / count
    no_signal = _zero_variance(flat, index, num_groups)
    # count - 1 is 0 only for single-sample groups, which no_signal already zeroes; the
    # clamp only keeps the discarded branch finite.
    others = (count - 1).clamp(min=1)

    baseline = (total - flat) / others if use_leave_one_out_baseline else mean
    advantages = flat - baseline

    if normalize_rewards:
        squared = _group_sum((flat - mean) ** 2, index, num_groups)[index]
        std = torch.sqrt(squared / others)
        advantages = advantages / (std + eps)

    advantages = torch.where(no_signal, torch.zeros_like(advantages), advantages)
    return advantages.to(rewards.dtype).reshape(rewards.shape)


def has_reward_variance(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry a gradient (rewards not all equal).

    For ``rewards`` of shape ``[num_prompts, G]`` returns a bool ``[num_prompts]``, one flag
    per group. For ``rewards`` ``[N]`` with ``group_ids`` returns a bool ``[N]``: each
    sample's flag is its group's, ready to select the samples to keep. A single-sample group
    has no variance (False).
    """
    index, num_groups = _group_index(rewards, group_ids)
    per_sample = ~_zero_variance(rewards.reshape(-1), index, num_groups)
    if group_ids is None:
        return per_sample.reshape(rewards.shape)[:, 0] if rewards.numel() else per_sample[:0]
    return per_sample


def overlong_sample_mask(
    finish_reasons: Sequence[str], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DAPO overlong filtering: a ``sample_mask`` ``[N]`` that is 0 for samples cut by the
    length limit (finish reason ``"length"``) and 1 otherwise.

    Multiply it into the batch's ``sample_mask`` before the global loss normalisers are
    counted, so the dropped samples leave the token and sequence counts too.
    """
    return torch.tensor(
        [0.0 if reason == "length" else 1.0 for reason in finish_reasons], dtype=dtype
    )


def soft_overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, a reward term ``[N]`` (alternative to filtering).

    With ``L`` the response length, ``L_max = max_length`` and ``L_c = buffer``::

        0                                 if L <= L_max - L_c
        penalty * (L_max - L_c - L) / L_c if L_max - L_c < L <= L_max
        -penalty                          if L > L_max
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length]; got {buffer} for {max_length}")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    start = max_length - buffer
    ramp = (start - lengths) / buffer
    out = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    out = torch.where(lengths > max_length, torch.full_like(ramp, -1.0), out)
    return (penalty * out).to(torch.float32)


def group_mean_baseline(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """``r_i - mean_g(r)`` per sample (float64, flattened to ``[N]``); exactly 0 for a group
    whose rewards are all equal and for a single-sample group."""
    index, num_groups = _group_index(rewards, group_ids)
    flat = rewards.reshape(-1).to(torch.float64)
    count = _group_sum(torch.ones_like(flat), index, num_groups)[index]
    centred = flat - _group_sum(flat, index, num_groups)[index] / count
    return torch.where(_zero_variance(flat, index, num_groups), torch.zeros_like(flat), centred)


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """``G_t = sum_{u >= t} gamma^k r_u`` over the valid tokens (``mask != 0``) of each row.

    ``k`` counts the valid tokens between ``t`` and ``u``: positions with mask 0 (prompt,
    environment observations, padding) are not time steps of the policy, so they neither
    carry a reward nor discount one; their returns are 0. ``[B, T]`` in, ``[B, T]`` out.
    """
    valid = mask != 0
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    if gamma == 1.0:
        # Undiscounted: a reversed cumulative sum, no loop over the sequence.
        returns = rewards.flip(1).cumsum(1).flip(1)
        return torch.where(valid, returns, torch.zeros_like(returns))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    baseline: bool = False,
    gamma: float = 1.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++ (``baseline=False``) and REINFORCE++-baseline token advantages ``[N, T]``
    (see the module docstring).

    Args:
        rewards: ``[N]`` outcome reward per sample.
        mask: ``[N, T]`` token weights; the valid tokens are where it is non-zero (the
            driver passes ``loss_mask * sample_mask``, so dropped samples count nowhere).
        group_ids: ``[N]`` group of each sample (needed for ``baseline=True``).
        baseline: subtract each group's mean reward first (REINFORCE++-baseline).
        gamma: discount per valid token, in [0, 1].
        kl: ``[N, T]`` per-token KL to the reference (``logp_old - logp_ref`` for k1);
            required when ``kl_coef > 0``.
        kl_coef: coefficient of the KL penalty in the token rewards.

    Returns:
        float32 advantages, 0 on invalid positions; mean 0 and (population) std 1 over the
        valid tokens unless they all share one return (then all 0).
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"rewards must be [N] and mask [N, T]; got {tuple(rewards.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if baseline and group_ids is None:
        raise ValueError("REINFORCE++-baseline needs the group of each sample (group_ids)")
    scores = group_mean_baseline(rewards, group_ids) if baseline else rewards.to(torch.float64)
    token_rewards = outcome_token_rewards(scores, mask, kl=kl, kl_coef=kl_coef)
    returns = discounted_returns(token_rewards, mask, gamma)
    return whiten(returns, mask).to(torch.float32)


def outcome_token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token rewards ``[N, T]`` (float64) of an outcome-scored batch, as in classic RLHF:
    ``-kl_coef * kl_t`` on every valid token (``mask != 0``) plus the sample's ``scores[i]``
    on its LAST valid token; 0 elsewhere (and everywhere in a row with no valid token)."""
    valid = mask != 0
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl_coef > 0:
        if kl is None:
            raise ValueError("kl_coef > 0 needs the per-token kl")
        penalty = -kl_coef * kl.to(device=mask.device, dtype=torch.float64)
        token_rewards = torch.where(valid, penalty, token_rewards)
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
    rows = (last >= 0).nonzero().squeeze(1)
    token_rewards[rows, last[rows]] += scores.to(torch.float64)[rows]
    return token_rewards


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = REINFORCE_PP_EPS) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with the mean and population std over the valid tokens
    (``mask != 0``) of the whole tensor; 0 on invalid positions, and 0 everywhere when the valid
    values are all equal (or there is none). Call it on the WHOLE global batch: whitening each
    rank's or micro batch's part on its own gives other numbers."""
    valid = mask != 0
    picked = values[valid]
    if picked.numel() == 0 or bool(picked.max() == picked.min()):
        return torch.zeros_like(values)
    out = (values - picked.mean()) / (picked.std(unbiased=False) + eps)
    return torch.where(valid, out, torch.zeros_like(out))


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the valid tokens (``mask != 0``) of each row.

    With ``t+1`` the NEXT valid token of the row (positions with mask 0 are not time steps, as
    in :func:`discounted_returns`) and ``V = 0`` after the last one (the episode ends)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = sum_{l >= 0} (gamma * lambda)^l * delta_{t+l}
        R_t     = A_t + V_t                       (the critic's regression target)

    Returns ``(advantages, returns)``, both ``[B, T]`` and 0 on invalid positions. Not
    whitened: whiten the advantages over the global batch with :func:`whiten` if wanted.
    """
    valid = mask != 0
    zeros = torch.zeros_like(token_rewards)
    rewards = torch.where(valid, token_rewards, zeros)
    values = torch.where(valid, values.to(rewards.dtype), zeros)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        here = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Masked positions carry the next valid token's value and advantage through unchanged.
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, running, zeros[:, t])
    returns = torch.where(valid, advantages + values, zeros)
    return advantages, returns
