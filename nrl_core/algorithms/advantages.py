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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "group_relative_advantages",
    "has_reward_variance",
    "overlong_sample_mask",
    "soft_overlong_penalty",
]


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
