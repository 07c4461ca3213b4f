"""The megatron backend as a PPO critic: a per-token value head in place of the LM output layer
(:class:`nrl_megatron.model.ValueHead`, zero at the start), trained by the core's step with the
clipped value loss (:class:`nrl_core.losses.value.ClippedValueLoss`).

Checked against the dtensor critic on the same weights and batch (the reference: same head on
the same final-norm hidden states), against a direct torch computation of the first loss, on
2 ranks (TP=2 and DP=2) against 1, packed against padded, and through the CLI (``nrl run ppo
critic.backend=megatron``, checkpoint and resume).

Tolerances, float32 on CPU, as in test_megatron.py: losses and gradient norms rel 1e-5, values
1e-5 absolute (the second step moves every backbone weight by ~lr under Adam: 1e-4 there).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import attrs
import pytest
import torch
from _megatron_helpers import requires_megatron, value_head_state

from nrl_core.algorithms.ppo import critic_batch
from nrl_core.config.schema import CriticConfig, OptimizerConfig, PolicyConfig, PPOConfig
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.interfaces import ComponentContext
from nrl_core.losses.value import ClippedValueLoss, ValueLossConfig
from nrl_core.policy import Policy
from nrl_core.testing.batches import make_batch

pytestmark = requires_megatron

WORKER = "nrl_megatron.worker:MegatronPolicyWorker"
RECORDING = "_megatron_helpers:RecordingMegatronWorker"
CLIP = 0.5


def critic_context(path, *, backend="megatron", packing="auto", budget=None) -> ComponentContext:
    """The context a run gives its critic ranks: the PPO config with ``policy`` = the critic
    section (nrl_core.algorithms.session.components.Components.start_critic)."""
    critic = CriticConfig(
        backend=backend,
        model_name=str(path),
        train_global_batch_size=8,
        train_micro_batch_size=2,
        micro_batch_token_budget=budget,
        logprob_batch_size=4,
        sequence_packing=packing,
        optimizer=OptimizerConfig(lr=1e-2),
    )
    config = PPOConfig(policy=PolicyConfig(model_name=str(path)), critic=critic)
    return ComponentContext(config=attrs.evolve(config, policy=config.critic), seed=0)


def options(tp=1):
    from nrl_megatron.config import MegatronConfig

    return MegatronConfig(tensor_model_parallel_size=tp)


def value_batch():
    """Lengths 4-40, GAE-like targets around 1 (one step from V = 0 has a direction to go)."""
    batch = make_batch(8, seed=3, min_len=4, max_len=40)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(batch["loss_mask"].shape, generator=g)
    returns = (1.0 + 0.3 * noise) * batch["loss_mask"]
    return batch, returns


def valid(values, batch):
    """The values at real tokens (padding is whatever a backend leaves there)."""
    width = batch["input_ids"].shape[1]
    return values[torch.arange(width)[None, :] < batch["lengths"][:, None]]


def two_steps(critic: Policy, batch, returns) -> dict:
    """Values before, after one and after two optimizer steps of the clipped value loss (the
    second step's old values are the first step's, as in a second rollout), and each step's
    metrics."""
    loss_fn = ClippedValueLoss(ValueLossConfig(clip_eps=CLIP))
    out = {"v0": critic.get_logprobs(batch)}
    out["m1"] = critic.train(critic_batch(batch, returns, out["v0"]), loss_fn)
    out["v1"] = critic.get_logprobs(batch)
    out["m2"] = critic.train(critic_batch(batch, returns, out["v1"]), loss_fn)
    out["v2"] = critic.get_logprobs(batch)
    return out


def assert_same_steps(got: dict, want: dict, batch, what: str, values_atol=1e-4) -> None:
    for key in ("m1", "m2"):
        for name in ("loss", "value_loss", "grad_norm"):
            assert got[key][name] == pytest.approx(want[key][name], rel=1e-5), (what, key, name)
        for name in ("value_clip_frac", "values_mean", "returns_mean"):
            assert got[key][name] == pytest.approx(want[key][name], rel=1e-5, abs=1e-7), (
                what,
                key,
                name,
            )
    torch.testing.assert_close(valid(got["v0"], batch), valid(want["v0"], batch), rtol=0, atol=0)
    torch.testing.assert_close(valid(got["v1"], batch), valid(want["v1"], batch), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        valid(got["v2"], batch), valid(want["v2"], batch), rtol=0, atol=values_atol
    )


def megatron_steps(pool, start_group, path, *, tp=1, packing=False, budget=None, name="critic"):
    """:func:`two_steps` of a megatron critic on ``pool``'s ranks, with every rank's value head
    state before and after and, per rank, the values of the last call (TP peers must agree)."""
    context = critic_context(path, packing=packing, budget=budget)
    worker = RECORDING if packing else WORKER
    group = start_group(pool, worker, (options(tp), context), name=name)
    batch, returns = value_batch()
    out = {"head0": group.run_all(value_head_state)}
    out.update(two_steps(Policy.from_config(group, context.config.policy), batch, returns))
    out["head2"] = group.run_all(value_head_state)
    out["per_rank"] = group.run_all("compute_logprobs", batch)
    if packing:
        out["seen"] = {kind for seen in group.run_all("seen") for kind in seen}
    return out


def test_value_head_starts_at_zero_and_steps_like_the_dtensor_critic(tiny_path, pool1, start_group):
    pytest.importorskip("nrl_dtensor", reason="nrl-dtensor not installed for the comparison")
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    batch, returns = value_batch()
    got = megatron_steps(pool1, start_group, tiny_path)
    (head,) = got["head0"]
    # The LM output layer is gone; the head is [1, hidden], zeros, replicated (not TP-split).
    assert not head["lm_head"] and not head["tensor_model_parallel"]
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny_path).hidden_size
    assert head["head"].shape == (1, hidden) and bool((head["head"] == 0).all())
    assert got["v0"].shape == batch["input_ids"].shape and bool((got["v0"] == 0).all())

    # The first loss, computed directly: V = V_old = 0, so 0.5 * R^2 over the critic's tokens
    # (the targets shifted one position left, critic_batch), token mean.
    target = critic_batch(batch, returns, got["v0"])
    mask = target["loss_mask"] != 0
    assert got["m1"]["value_loss"] == pytest.approx(
        float((0.5 * target["returns"][mask].double() ** 2).mean()), rel=1e-6
    )
    # It learns: the first step lowers the squared error (the second, at lr 1e-2 on every
    # backbone weight, may overshoot), and the head moved.
    error = [float(((v - target["returns"])[mask] ** 2).mean()) for v in (got["v0"], got["v1"])]
    assert error[1] < error[0]
    assert got["head2"][0]["head"].abs().max() > 0

    # The dtensor critic (AutoModelForSequenceClassification's score head, zero-initialised)
    # on the same checkpoint and batch, in this process: the same two steps.
    context = critic_context(tiny_path, backend="dtensor")
    worker = DTensorPolicyWorker(DTensorConfig(), context)
    want = two_steps(
        Policy.from_config(InProcessGroup(worker), context.config.policy), batch, returns
    )
    assert_same_steps(got, want, batch, "megatron vs dtensor")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_ranks_match_one(tiny_path, pool1, pool2, start_group, tp):
    batch, _ = value_batch()
    want = megatron_steps(pool1, start_group, tiny_path, name="one")
    got = megatron_steps(pool2, start_group, tiny_path, tp=tp, name=f"two-tp{tp}")
    assert_same_steps(got, want, batch, f"2 ranks, tp={tp}", values_atol=1e-5)
    # The replicated head stays the same on both ranks (TP peers: same inputs, same gradient;
    # DP peers: averaged gradients), and tensor-parallel peers return the same values.
    first, second = (state["head"] for state in got["head2"])
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    if tp == 2:
        torch.testing.assert_close(got["per_rank"][0], got["per_rank"][1], rtol=0, atol=0)


@pytest.mark.parametrize("budget", [None, 60])
def test_packed_critic_matches_padded(tiny_path, pool1, start_group, budget):
    batch, _ = value_batch()
    want = megatron_steps(pool1, start_group, tiny_path, packing=False, name="padded")
    got = megatron_steps(
        pool1, start_group, tiny_path, packing=True, budget=budget, name=f"packed{budget}"
    )
    assert got["seen"] == {"packed"}
    assert_same_steps(got, want, batch, f"packed, budget {budget}", values_atol=1e-5)


PPO_CONFIG = """
ppo:
  max_num_steps: 3
  val_period: 0
  sft_warmup_steps: 0
  critic_warmup_steps: 1
  num_prompts_per_step: 4
  num_generations_per_prompt: 2
policy:
  backend: megatron
  num_workers: 1
  train_global_batch_size: 8
  train_micro_batch_size: 4
critic:
  backend: megatron
  num_workers: 1
  train_global_batch_size: 8
  train_micro_batch_size: 4
data:
  dataset: tiny_prompts
env:
  name: even_characters
checkpointing:
  save_period: 3
cluster:
  num_cpus: 2
"""
PPO_METRICS = (
    "train/value_loss",
    "train/value_clip_frac",
    "train/values_mean",
    "train/returns_mean",
    "train/advantages_mean",
    "train/advantages_std",
    "train/critic_grad_norm",
    "train/reward_mean",
)


def ppo(root: Path, *overrides: str, quiet: bool = True):
    """``nrl run ppo`` of PPO_CONFIG (megatron policy and critic) with the fixture plugin of
    test_grpo_cli.py; logs in ``root / "logs" / "run"``, checkpoints in ``root / "ckpt"``."""
    from test_grpo_cli import nrl

    return nrl(
        root,
        "run",
        "ppo",
        *(["-q"] if quiet else []),
        "--config",
        str(root / "ppo.yaml"),
        f"logger.log_dir={root / 'logs'}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={root / 'ckpt'}",
        *overrides,
    )


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("nrl_dtensor") is None,
    reason="nrl-dtensor (the `torch` generation backend) not installed; nox installs it",
)
def test_three_ppo_steps_with_the_megatron_critic_from_the_cli_then_resume(tmp_path):
    from test_grpo_cli import install_fixture_plugin

    install_fixture_plugin(tmp_path)
    (tmp_path / "ppo.yaml").write_text(PPO_CONFIG)
    done = ppo(tmp_path, quiet=False)
    assert "critic: 1 megatron rank ready" in done.stdout, done.stdout[-3000:]

    def records():
        lines = (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    first = records()
    assert sorted(first) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        record = first[step]
        for key in PPO_METRICS:
            assert math.isfinite(record[key]), (step, key, record.get(key))
        # The fixture's reward varies between samples: the returns do, so this is a number.
        assert math.isfinite(record["train/explained_variance"]), step
        assert record["train/value_loss"] > 0 and record["train/critic_grad_norm"] > 0
    # Step 1 trains the critic only, from V = 0: it explains nothing yet.
    assert first[1]["train/critic_warmup"] == 1
    assert first[1]["train/values_mean"] == 0.0
    assert first[1]["train/explained_variance"] == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(first[2]["train/loss"]) and first[2]["train/grad_norm"] > 0

    # The critic's checkpoint: its value head (trained away from 0), no LM head.
    from nrl_megatron.model import VALUE_HEAD

    critic = tmp_path / "ckpt" / "step_3" / "critic"
    state = torch.load(critic / "rank0.pt", weights_only=False)
    assert "output_layer.weight" not in state["model"]
    assert state["model"][VALUE_HEAD].abs().max() > 0 and state["optimizer"] is not None
    assert (tmp_path / "ckpt" / "step_3" / "policy" / "rank0.pt").is_file()

    # Resume from it for one more step: policy and critic restored, training goes on.
    resumed = ppo(tmp_path, "ppo.max_num_steps=4", quiet=False)
    assert "resuming from" in resumed.stdout + resumed.stderr
    after = records()
    assert sorted(after) == [0, 1, 2, 3, 4]
    for key in PPO_METRICS:
        assert math.isfinite(after[4][key]), (key, after[4].get(key))
    # The restored critic is the trained one: its values are no longer the fresh head's 0.
    assert after[4]["train/values_mean"] != 0.0
