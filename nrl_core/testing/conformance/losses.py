"""The loss suite (:class:`LossConformance`), with the test loss and batches the policy suite
also uses."""

from __future__ import annotations

import math

import pytest

from nrl_core.testing.batches import TokenMeanNLL
from nrl_core.testing.conformance.common import _check_registration

__all__ = ["LossConformance", "TokenMeanNLL", "random_batch"]


def random_batch(rows: int = 8, width: int = 12, vocab_size: int = 64, seed: int = 0, dtype=None):
    """A right-padded batch with every standard key and ``[B, T]`` logprobs for it.

    Each row has a prompt of 1-3 tokens, then generated tokens, then padding; the last row has
    ``sample_mask`` 0. Returns ``(logprobs, batch)``; the logprob-like keys are close to (not
    equal to) ``logprobs`` so that ratios and KL terms are non-trivial.
    """
    import torch

    from nrl_core.data import Batch

    dtype = dtype or torch.float64
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, width + 1, (rows,), generator=gen)
    prompt = torch.randint(1, 4, (rows,), generator=gen)
    pos = torch.arange(width)[None, :]
    valid = pos < lengths[:, None]
    loss_mask = (valid & (pos >= prompt[:, None])).to(dtype)
    input_ids = torch.randint(1, vocab_size, (rows, width), generator=gen) * valid
    sample_mask = torch.ones(rows, dtype=dtype)
    sample_mask[-1] = 0.0

    def near(scale: float):
        noise = torch.randn(rows, width, generator=gen, dtype=dtype) * scale
        return ((logprobs + noise).clamp(max=0.0)) * valid

    logprobs = -torch.rand(rows, width, generator=gen, dtype=dtype) * 3 * valid
    logprobs[:, 0] = 0.0
    advantages = torch.randn(rows, generator=gen, dtype=dtype)[:, None].expand(rows, width)
    batch = Batch(
        {
            "input_ids": input_ids,
            "lengths": lengths,
            "loss_mask": loss_mask,
            "sample_mask": sample_mask,
            "advantages": advantages * loss_mask,
            "prev_logprobs": near(0.05),
            "gen_logprobs": near(0.05),
            "ref_logprobs": near(0.2),
        }
    )
    return logprobs, batch


def _stats(batch, max_sequence_length: int):
    from nrl_core.interfaces import GlobalBatchStats

    mask = batch["loss_mask"]
    if "sample_mask" in batch:
        mask = mask * batch["sample_mask"][:, None]
    return GlobalBatchStats(
        valid_tokens=float(mask.sum()),
        valid_sequences=float((mask.sum(dim=1) > 0).sum()),
        max_sequence_length=max_sequence_length,
    )


class LossConformance:
    """The :class:`~nrl_core.interfaces.LossFunction` contract.

    Provide the fixture ``loss_fn`` (a built loss). Optional fixture ``inputs`` returning
    ``(logprobs, batch)`` (default: :func:`random_batch`, every standard key); class attributes
    ``micro_batch_size`` (rows per micro batch in the invariance checks; keep paired rows such
    as DPO's chosen/rejected together), ``max_sequence_length`` and ``rtol``.

    The central property is micro-batch invariance: the loss, its gradient and its reduced
    metrics must not depend on how the core cuts the global batch into micro batches and
    data-parallel shards.
    """

    micro_batch_size: int = 2
    max_sequence_length: int = 16
    rtol: float = 1e-9
    registered_name: str | None = None

    @pytest.fixture
    def loss_fn(self):
        """The loss under test (override)."""
        pytest.fail("define a `loss_fn` fixture that builds the loss")

    @pytest.fixture
    def inputs(self):
        """``(logprobs, batch)`` the loss is evaluated on."""
        return random_batch()

    def _run(self, loss_fn, logprobs, batch, parts):
        """Loss, gradient and reduced metrics summed over row ranges ``parts``."""
        import torch

        from nrl_core.training import logprobs_at_key, reduce_metrics

        stats = _stats(batch, self.max_sequence_length)
        # A loss with `logprobs_at_key` (distillation) also gets its gradient through
        # batch["logprobs_at"] ([B, T, K]): the gradient is then [B, T, 1 + K].
        at_key = logprobs_at_key(loss_fn)
        total, grads, metrics = 0.0, [], []
        for start, stop in parts:
            rows = logprobs[start:stop].detach().clone().requires_grad_(True)
            part = batch.slice(start, stop)
            if at_key is not None:
                at = part["logprobs_at"].detach().clone().requires_grad_(True)
                part["logprobs_at"] = at
            loss, part_metrics = loss_fn(rows, part, stats)
            loss.backward()
            total += float(loss.detach())
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            if at_key is not None:
                at_grad = at.grad if at.grad is not None else torch.zeros_like(at)
                grad = torch.cat([grad[..., None], at_grad], dim=-1)
            grads.append(grad)
            metrics.append(part_metrics)
        return total, torch.cat(grads), reduce_metrics(metrics)

    def _micro_parts(self, size: int):
        step = self.micro_batch_size
        return [(s, min(s + step, size)) for s in range(0, size, step)]

    def test_flags_and_output_types(self, loss_fn, inputs):
        import torch

        assert isinstance(loss_fn.needs_reference, bool)
        assert isinstance(loss_fn.needs_prev_logprobs, bool)
        logprobs, batch = inputs
        lp = logprobs.clone().requires_grad_(True)
        loss, metrics = loss_fn(lp, batch, _stats(batch, self.max_sequence_length))
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        assert loss.requires_grad, "the loss must carry the graph back to the logprobs"
        assert torch.isfinite(loss)
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert isinstance(key, str)
            assert isinstance(value, float) and math.isfinite(value), f"metric {key}={value!r}"

    def test_gradient_only_on_valid_tokens(self, loss_fn, inputs):
        import torch

        logprobs, batch = inputs
        _, grad, _ = self._run(loss_fn, logprobs, batch, [(0, len(batch))])
        assert torch.isfinite(grad).all()
        valid = batch["loss_mask"].bool()
        if "sample_mask" in batch:
            valid &= batch["sample_mask"].bool()[:, None]
        assert (grad[~valid] == 0).all(), "gradient on prompt, padding or masked-out samples"
        assert (grad[valid] != 0).any(), "no gradient reaches the valid tokens"

    def test_micro_batch_invariance(self, loss_fn, inputs):
        import torch

        logprobs, batch = inputs
        whole = self._run(loss_fn, logprobs, batch, [(0, len(batch))])
        micro = self._run(loss_fn, logprobs, batch, self._micro_parts(len(batch)))
        assert micro[0] == pytest.approx(whole[0], rel=self.rtol, abs=self.rtol)
        torch.testing.assert_close(micro[1], whole[1], rtol=self.rtol, atol=self.rtol)
        assert micro[2].keys() == whole[2].keys()
        for key in whole[2]:
            assert micro[2][key] == pytest.approx(whole[2][key], rel=1e-6, abs=1e-9), key

    def test_deterministic_and_pure(self, loss_fn, inputs):
        logprobs, batch = inputs
        before = {k: batch[k].clone() for k in batch.tensors}
        first = self._run(loss_fn, logprobs, batch, [(0, len(batch))])
        again = self._run(loss_fn, logprobs, batch, [(0, len(batch))])
        assert first[0] == again[0] and (first[1] == again[1]).all()
        for key, value in before.items():
            assert (batch[key] == value).all(), f"the loss modified batch[{key!r}]"

    def test_missing_reference_is_an_error(self, loss_fn, inputs):
        if not loss_fn.needs_reference:
            pytest.skip("the loss does not need ref_logprobs")
        from nrl_core.data import Batch

        logprobs, batch = inputs
        stripped = Batch({k: batch[k] for k in batch.tensors if k != "ref_logprobs"})
        with pytest.raises((KeyError, ValueError)):
            loss_fn(logprobs.clone().requires_grad_(True), stripped, _stats(batch, 16))

    def test_registered(self, loss_fn):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("loss", self.registered_name, loss_fn)
