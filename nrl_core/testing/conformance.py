"""Conformance suites: the interface contract of each component kind, as pytest test classes.

A plugin's test module subclasses the suite of its component kind and provides the fixtures
that build the component; every ``test_*`` method of the suite then runs against it::

    import pytest
    from nrl_core.interfaces import ComponentContext
    from nrl_core.testing.conformance import EnvCase, EnvironmentConformance

    class TestMyEnvironment(EnvironmentConformance):
        registered_name = "my_env"          # also check the plugin registers it

        @pytest.fixture
        def environment(self):
            return MyEnvironment(None, ComponentContext(config=None))

        @pytest.fixture
        def cases(self):
            return [EnvCase(conversation("2+2=", "4"), {"answer": "4"}, reward=1.0)]

Suites (fixtures to provide in brackets; see each class for the optional ones):

- :class:`EnvironmentConformance` (``environment``, ``cases``)
- :class:`DatasetConformance` (``loader``)
- :class:`LossConformance` (``loss_fn``)
- :class:`PolicyConformance` (``policy``)
- :class:`GenerationConformance` (``generator``, ``prompts``)

The suites only use the component through its interface (:mod:`nrl_core.interfaces`) and run
in one process without Ray, so a whole suite takes seconds on a CPU with the tiny model.
This module imports torch lazily: the environment and dataset suites do not need it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from nrl_core.data import Message

__all__ = [
    "DatasetConformance",
    "EnvCase",
    "EnvironmentConformance",
    "GenerationConformance",
    "LossConformance",
    "PolicyConformance",
    "TokenMeanNLL",
    "conversation",
    "random_batch",
]


def conversation(prompt: str, response: str, system: str | None = None) -> list[Message]:
    """A one-turn conversation as the core hands it to ``Environment.step``."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return messages


def _registered(kind: str, name: str):
    """The spec of ``kind``/``name`` from every installed plugin (fails with nrl's message)."""
    from nrl_core.plugins import PluginHost

    host = PluginHost.discover()
    broken = {i.name: i.error for i in host.broken()}
    assert not broken, f"plugins failed to load: {broken}"
    return host.registry().get(kind, name)  # type: ignore[arg-type]


def _check_registration(kind: str, name: str, component: Any) -> None:
    spec = _registered(kind, name)
    target = spec.load()
    assert isinstance(component, target), (
        f"{kind} {name!r} is registered as {spec.target_str}, but the tested component is a "
        f"{type(component).__module__}.{type(component).__qualname__}"
    )
    config_class = spec.load_config_class()
    if config_class is not None:
        assert attrs.has(config_class), f"config class of {kind} {name!r} must be an attrs class"
        config_class()  # every option needs a default: configs may leave the section out
        undocumented = [f.name for f in attrs.fields(config_class) if not f.metadata.get("doc")]
        assert not undocumented, (
            f"options of {kind} {name!r} without documentation (use nrl_core.config.schema."
            f"option(default, doc)): {undocumented}"
        )


# ---------------------------------------------------------------------------------------------
# Environment


@attrs.frozen
class EnvCase:
    """One sample for the environment suite: a conversation ending with the assistant's
    response, the sample's metadata (what the core passes: the dataset's ``answer`` and
    ``task`` plus the sample's own metadata) and, optionally, the expected total reward."""

    messages: list[Message]
    metadata: dict[str, Any]
    reward: float | None = None


def _total(reward: float | dict[str, float]) -> float:
    return float(sum(reward.values())) if isinstance(reward, dict) else float(reward)


class EnvironmentConformance:
    """The :class:`~nrl_core.interfaces.Environment` contract.

    Provide the fixtures ``environment`` (a built environment) and ``cases`` (a list of
    :class:`EnvCase`; include at least one rewarded and one unrewarded response). Optional:

    - ``registered_name``: the name the plugin registers; checks that the registered target is
      the tested class and that its config class is documented and default-constructible.
    - ``single_turn``: ``True`` (default) requires every step to end the episode.
    """

    registered_name: str | None = None
    single_turn: bool = True

    @pytest.fixture
    def environment(self):
        """The environment under test (override)."""
        pytest.fail("define an `environment` fixture that builds the environment")

    @pytest.fixture
    def cases(self) -> list[EnvCase]:
        """The samples to step (override)."""
        pytest.fail("define a `cases` fixture returning a list of EnvCase")

    @staticmethod
    def _step(environment, cases: Sequence[EnvCase]):
        return environment.step([c.messages for c in cases], [c.metadata for c in cases])

    def test_step_returns_one_envstep_per_sample(self, environment, cases):
        from nrl_core.interfaces import EnvStep

        assert len(cases) >= 2, "give at least two cases (one rewarded, one not)"
        steps = list(self._step(environment, cases))
        assert len(steps) == len(cases)
        for step in steps:
            assert isinstance(step, EnvStep), f"step must return EnvStep, got {type(step)}"

    def test_rewards_are_finite_numbers(self, environment, cases):
        for step in self._step(environment, cases):
            values = step.reward.values() if isinstance(step.reward, dict) else [step.reward]
            if isinstance(step.reward, dict):
                assert step.reward and all(isinstance(k, str) for k in step.reward)
            for value in values:
                assert isinstance(value, (int, float)) and not isinstance(value, bool)
                assert math.isfinite(value), f"reward {value} is not finite"

    def test_expected_rewards(self, environment, cases):
        expected = [(i, c.reward) for i, c in enumerate(cases) if c.reward is not None]
        assert expected, "give the expected reward of at least one case"
        steps = self._step(environment, cases)
        for i, reward in expected:
            assert _total(steps[i].reward) == pytest.approx(reward), f"case {i}"
        totals = {_total(s.reward) for s in steps}
        assert len(totals) > 1, "every case got the same reward: the reward cannot teach anything"

    def test_deterministic(self, environment, cases):
        first = [_total(s.reward) for s in self._step(environment, cases)]
        again = [_total(s.reward) for s in self._step(environment, cases)]
        assert first == again

    def test_batch_composition_does_not_change_results(self, environment, cases):
        # The core splits batches across environment actors and retries failing batches sample
        # by sample, so each sample's result must not depend on its neighbours.
        batched = [_total(s.reward) for s in self._step(environment, cases)]
        single = [_total(self._step(environment, [c])[0].reward) for c in cases]
        reverse = [_total(s.reward) for s in self._step(environment, cases[::-1])][::-1]
        assert batched == single == reverse

    def test_empty_batch(self, environment):
        assert list(environment.step([], [])) == []

    def test_inputs_are_not_mutated(self, environment, cases):
        messages = [copy.deepcopy(c.messages) for c in cases]
        metadata = [copy.deepcopy(c.metadata) for c in cases]
        self._step(environment, cases)
        assert [c.messages for c in cases] == messages
        assert [c.metadata for c in cases] == metadata

    def test_turn_structure(self, environment, cases):
        for step in self._step(environment, cases):
            if self.single_turn:
                assert step.terminated, "a single-turn environment must end every episode"
            if not step.terminated:
                assert step.observation is not None, "a continuing episode needs an observation"
            if step.observation is not None:
                assert isinstance(step.observation.get("role"), str)
                assert isinstance(step.observation.get("content"), str)
            if step.stop_strings is not None:
                assert all(isinstance(s, str) and s for s in step.stop_strings)
            if step.metadata is not None:
                assert isinstance(step.metadata, dict)

    def test_registered(self, environment):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("environment", self.registered_name, environment)


# ---------------------------------------------------------------------------------------------
# Dataset


class DatasetConformance:
    """The :class:`~nrl_core.interfaces.DatasetLoader` contract.

    Provide the fixture ``loader`` (a built loader). Optional: ``splits`` (the splits the
    dataset has; default ``("train",)``) and ``registered_name``.
    """

    splits: tuple[str, ...] = ("train",)
    registered_name: str | None = None

    @pytest.fixture
    def loader(self):
        """The dataset loader under test (override)."""
        pytest.fail("define a `loader` fixture that builds the dataset loader")

    def test_splits_hold_samples(self, loader):
        from nrl_core.data import Sample

        for split in self.splits:
            samples = loader.load(split)
            assert isinstance(samples, list) and samples, f"split {split!r} is empty"
            for sample in samples:
                assert isinstance(sample, Sample)
                assert isinstance(sample.task, str) and sample.task
                assert isinstance(sample.metadata, dict)

    def test_prompts_are_chat_messages(self, loader):
        for split in self.splits:
            for sample in loader.load(split):
                assert sample.messages, "a sample needs at least one message"
                for message in sample.messages:
                    assert message.get("role") in ("system", "user", "assistant")
                    assert isinstance(message.get("content"), str)
                # The policy answers the prompt, so it must not end with the answer already.
                assert sample.messages[-1]["role"] != "assistant"

    def test_deterministic(self, loader):
        for split in self.splits:
            assert loader.load(split) == loader.load(split)

    def test_unknown_split_raises_key_error(self, loader):
        # load_splits() falls back to a held-out fraction on KeyError, and only on KeyError.
        with pytest.raises(KeyError):
            loader.load("no-such-split")

    def test_registered(self, loader):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("dataset", self.registered_name, loader)


# ---------------------------------------------------------------------------------------------
# Loss


class TokenMeanNLL:
    """A minimal loss honouring the contract: token-mean NLL over ``loss_mask * sample_mask``,
    divided by the GLOBAL token count. Used by :class:`PolicyConformance` to train."""

    needs_reference = False
    needs_prev_logprobs = False

    def __call__(self, logprobs, batch, stats):
        mask = batch["loss_mask"].to(logprobs.dtype)
        if "sample_mask" in batch:
            mask = mask * batch["sample_mask"].to(logprobs.dtype)[:, None]
        nll = -(logprobs * mask).sum()
        return nll / max(stats.valid_tokens, 1.0), {
            "loss": float(nll.detach()) / max(stats.valid_tokens, 1.0)
        }


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


# ---------------------------------------------------------------------------------------------
# Policy


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


# ---------------------------------------------------------------------------------------------
# Generation


class GenerationConformance:
    """The :class:`~nrl_core.interfaces.GenerationWorker` contract.

    Provide the fixtures ``generator`` and ``prompts`` (at least three token-id prompts of
    different lengths, valid for the model). Optional fixture ``tokenizer`` (default ``None``;
    enables the stop-string check) and class attribute ``max_new_tokens``.
    """

    max_new_tokens: int = 8
    registered_name: str | None = None

    @pytest.fixture
    def generator(self):
        """The generation worker under test (override)."""
        pytest.fail("define a `generator` fixture that builds the generation worker")

    @pytest.fixture
    def prompts(self) -> list[list[int]]:
        """Token-id prompts (override)."""
        pytest.fail("define a `prompts` fixture: token-id prompts of different lengths")

    @pytest.fixture
    def tokenizer(self):
        """The model's tokenizer, or ``None`` to skip the text checks."""
        return None

    def _params(self, **kwargs):
        from nrl_core.interfaces import SamplingParams

        kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        return SamplingParams(**kwargs)

    def test_output_structure(self, generator, prompts):
        from nrl_core.interfaces import GenerationOutput

        assert len(prompts) >= 3 and len({len(p) for p in prompts}) > 1
        out = generator.generate(prompts, self._params(seed=0))
        assert isinstance(out, GenerationOutput)
        assert len(out.token_ids) == len(out.logprobs) == len(out.finish_reasons) == len(prompts)
        for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons, strict=True):
            assert all(isinstance(t, int) and t >= 0 for t in ids), "token ids must be ints"
            assert len(ids) == len(lps) and 1 <= len(ids) <= self.max_new_tokens
            assert all(math.isfinite(x) and x <= 1e-5 for x in lps), "logprobs must be <= 0"
            assert reason in ("stop", "length")
            if reason == "length":
                assert len(ids) == self.max_new_tokens
            else:
                assert len(ids) <= self.max_new_tokens

    def test_greedy_is_deterministic_and_batch_independent(self, generator, prompts):
        params = self._params(temperature=0.0)
        out = generator.generate(prompts, params)
        assert generator.generate(prompts, params).token_ids == out.token_ids
        # Padding and batching must not leak between prompts.
        alone = [generator.generate([p], params).token_ids[0] for p in prompts]
        assert alone == out.token_ids

    def test_seeded_sampling_is_reproducible(self, generator, prompts):
        runs = [
            generator.generate(prompts, self._params(max_new_tokens=16, seed=s)).token_ids
            for s in (1, 1, 2)
        ]
        assert runs[0] == runs[1], "the same seed must give the same samples"
        assert runs[0] != runs[2], "different seeds gave identical samples"

    def test_token_ids_round_trip_as_prompts(self, generator, prompts):
        # Feeding a prompt plus the first generated ids back must continue identically (greedy):
        # the ids generation returns are exactly the ids the model saw.
        params = self._params(temperature=0.0)
        out = generator.generate(prompts, params)
        cut = 3
        resumed = generator.generate(
            [list(p) + ids[:cut] for p, ids in zip(prompts, out.token_ids, strict=True)],
            self._params(temperature=0.0, max_new_tokens=self.max_new_tokens - cut),
        )
        for ids, rest, reason in zip(
            out.token_ids, resumed.token_ids, out.finish_reasons, strict=True
        ):
            if len(ids) > cut:
                assert rest[: len(ids) - cut] == ids[cut:]
            elif reason == "stop":
                continue  # already stopped inside the prefix

    def test_stop_token_ids(self, generator, prompts):
        greedy = generator.generate(prompts, self._params(temperature=0.0))
        ids = greedy.token_ids[0]
        if len(ids) < 3:
            pytest.skip("greedy generation stopped too early to pick a stop token")
        stop = ids[2]
        out = generator.generate(prompts, self._params(temperature=0.0, stop_token_ids=(stop,)))
        first = out.token_ids[0]
        assert first == ids[: ids.index(stop) + 1], "must stop at (and include) the stop token"
        assert out.finish_reasons[0] == "stop"

    def test_per_sample_stop_strings(self, generator, prompts, tokenizer):
        if tokenizer is None:
            pytest.skip("no tokenizer fixture")
        greedy = generator.generate(prompts, self._params(temperature=0.0))
        text = tokenizer.decode(greedy.token_ids[0], skip_special_tokens=True)
        if len(text) < 3:
            pytest.skip("greedy text too short to pick a stop string")
        stop = text[1:3]
        out = generator.generate(
            prompts,
            self._params(temperature=0.0),
            stop_strings=[(stop,)] + [None] * (len(prompts) - 1),
        )
        got = tokenizer.decode(out.token_ids[0], skip_special_tokens=True)
        assert stop in got and len(out.token_ids[0]) <= len(greedy.token_ids[0])
        assert out.finish_reasons[0] == "stop"
        assert out.token_ids[1:] == greedy.token_ids[1:], "a stop string leaked to other samples"

    def test_registered(self, generator):
        if self.registered_name is None:
            pytest.skip("set registered_name to check the plugin's registration")
        _check_registration("generation", self.registered_name, generator)
