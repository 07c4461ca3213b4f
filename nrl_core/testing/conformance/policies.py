"""The policy-worker suite: :class:`PolicyConformance`."""

from __future__ import annotations

import math

import pytest

from nrl_core.testing.conformance.common import _check_registration
from nrl_core.testing.conformance.losses import TokenMeanNLL, random_batch


class PolicyConformance:
    """The :class:`~nrl_core.interfaces.PolicyWorker` contract, on one rank in this process.

    Provide the fixture ``policy`` (a freshly built single-process worker; a new one per test,
    because training changes it). The suite drives it through the core's own training step
    (:class:`nrl_core.policy.Policy` over an in-process group, micro batches of 3), exactly as
    a run does. Optional: ``vocab_size`` (ids of the random batches are drawn below it),
    ``atol`` (logprob tolerance), ``check_export`` (``False`` skips the ``export_hf`` round
    trip, which loads with ``transformers.AutoModelForCausalLM``).
    """

    vocab_size: int = 64
    atol: float = 1e-5
    check_export: bool = True
    registered_name: str | None = None

    @pytest.fixture
    def policy(self):
        """A fresh single-process policy worker (override)."""
        pytest.fail("define a `policy` fixture that builds a single-process worker")

    @pytest.fixture
    def batch(self):
        """The batch the policy is checked on (8 rows, right padded)."""
        _, batch = random_batch(rows=8, width=12, vocab_size=self.vocab_size, seed=1)
        batch["loss_mask"] = batch["loss_mask"].float()
        batch["sample_mask"] = batch["sample_mask"].float()
        return batch

    @staticmethod
    def _facade(worker, batch):
        from nrl_core.distributed.worker_group import InProcessGroup
        from nrl_core.policy import Policy

        return Policy(
            InProcessGroup(worker),
            max_sequence_length=batch["input_ids"].shape[1],
            train_global_batch_size=len(batch),
            train_micro_batch_size=3,
            logprob_batch_size=3,
        )

    def _close(self, a, b, msg: str = "") -> None:
        import torch

        torch.testing.assert_close(a, b, atol=self.atol, rtol=0, msg=msg or None)

    def test_logprobs_shape_and_alignment(self, policy, batch):
        import torch

        lp = self._facade(policy, batch).get_logprobs(batch)
        assert isinstance(lp, torch.Tensor)
        assert tuple(lp.shape) == tuple(batch["input_ids"].shape)
        assert lp.dtype.is_floating_point and torch.isfinite(lp).all()
        assert (lp[:, 0] == 0).all(), "position 0 has no logprob and must hold 0"
        pos = torch.arange(lp.shape[1])[None, :]
        padding = pos >= batch["lengths"][:, None]
        assert (lp[padding] == 0).all(), "padding positions must hold 0"
        assert (lp[~padding][1:] <= 1e-6).all(), "logprobs must be <= 0"

    def test_logprobs_are_deterministic_and_row_independent(self, policy, batch):
        facade = self._facade(policy, batch)
        full = facade.get_logprobs(batch)
        self._close(facade.get_logprobs(batch), full, "two calls differ")
        # A row's logprobs must not depend on its neighbours (padding, micro batching, order).
        order = list(range(len(batch)))[::-1]
        self._close(facade.get_logprobs(batch.select(order)), full[order], "order changes rows")
        self._close(facade.get_logprobs(batch.slice(0, 3)), full[:3], "a subset changes rows")

    def test_forward_backward_calls_the_loss_once(self, policy, batch):
        micro_batch = batch.slice(0, 2).trimmed()
        calls = []

        def loss(logprobs):
            calls.append(tuple(logprobs.shape))
            assert logprobs.requires_grad, "forward_backward must pass logprobs with a graph"
            mask = micro_batch["loss_mask"].to(logprobs.device, logprobs.dtype)
            return -(logprobs * mask).sum()

        policy.forward_backward(micro_batch, loss)
        expected = tuple(micro_batch["input_ids"].shape)
        assert calls == [expected], f"the loss closure was called with {calls}, want [{expected}]"
        step = policy.optimizer_step()
        assert set(step) >= {"grad_norm", "lr"}
        assert float(step["grad_norm"]) > 0 and math.isfinite(float(step["lr"]))

    def test_train_step(self, policy, batch):
        import torch

        facade = self._facade(policy, batch)
        before = facade.get_logprobs(batch)
        reference = facade.get_logprobs(batch, reference=True)
        self._close(reference, before, "reference != initial policy")
        metrics = facade.train(batch, TokenMeanNLL())
        assert isinstance(metrics, dict)
        for key in ("grad_norm", "lr", "loss"):
            assert key in metrics and math.isfinite(float(metrics[key])), key
        assert float(metrics["grad_norm"]) > 0
        # The reported loss is the loss that was back-propagated: the token-mean NLL of the
        # batch under the weights before the step (counted once, whatever the micro batches).
        mask = batch["loss_mask"] * batch["sample_mask"][:, None]
        expected = float(-(before * mask).sum() / mask.sum())
        assert abs(metrics["loss"] - expected) <= 1e-4 * abs(expected), (metrics["loss"], expected)
        after = facade.get_logprobs(batch)
        assert not torch.allclose(after, before), "training did not change the logprobs"
        valid = batch["loss_mask"].bool()
        assert after[valid].mean() > before[valid].mean(), "an NLL step must raise the logprobs"
        self._close(facade.get_logprobs(batch, reference=True), before, "the reference moved")

    def test_set_reference(self, policy, batch, tmp_path):
        if not self.check_export:
            pytest.skip("check_export is off (set_reference loads an exported folder)")
        facade = self._facade(policy, batch)
        facade.train(batch, TokenMeanNLL())
        trained = facade.get_logprobs(batch)
        facade.snapshot_reference(str(tmp_path / "reference"))
        self._close(facade.get_logprobs(batch, reference=True), trained, "reference != snapshot")

    def test_checkpoint_round_trip(self, policy, batch, tmp_path):
        facade = self._facade(policy, batch)
        start = facade.get_logprobs(batch)
        facade.save_checkpoint(str(tmp_path / "ckpt"))
        facade.train(batch, TokenMeanNLL())
        trained = facade.get_logprobs(batch)
        facade.load_checkpoint(str(tmp_path / "ckpt"))
        self._close(facade.get_logprobs(batch), start, "load did not restore the weights")
        # The optimizer state comes back too: the same step lands on the same weights.
        facade.train(batch, TokenMeanNLL())
        self._close(facade.get_logprobs(batch), trained, "the step after load differs")

    def test_export_hf_round_trip(self, policy, batch, tmp_path):
        if not self.check_export:
            pytest.skip("check_export is off")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        policy.export_hf(str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        AutoTokenizer.from_pretrained(tmp_path / "hf")
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        lp = torch.nn.functional.pad(lp, (1, 0))
        pos = torch.arange(lp.shape[1])[None, :]
        lp = lp * (pos < batch["lengths"][:, None])
        # The exported model is the trainer's model (the trainer may scale logits by the
        # generation temperature; the tests' configs keep it at 1).
        exported = self._facade(policy, batch).get_logprobs(batch).float()
        self._close(lp, exported, "exported weights differ")

    def test_registered(self, policy):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("policy", self.registered_name, policy)
