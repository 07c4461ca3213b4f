"""A mixture-of-experts model (the tiny Qwen3-MoE, 4 experts, top-2) in the dtensor policy on
CPU: training, router statistics, torch generation, checkpoints, export, FSDP2 over experts,
refit of separate engines. Real ``from_pretrained``, real gloo ranks where marked ``slow``."""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig
from test_dtensor import full_params, group_policy, local_policy, local_worker, make_config

from nrl_core.data import Batch, pad_sequences
from nrl_core.interfaces import SamplingParams
from nrl_core.testing.batches import TokenMeanNLL, make_batch
from nrl_core.testing.moe import transformers_router_metrics
from nrl_core.training import valid_token_mask

EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(
        tmp_path_factory.mktemp("nrl-moe"),
        arch="qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )


def assert_metrics_close(got: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, got[key], value)


def test_the_tiny_moe_is_a_qwen3_moe_that_from_pretrained_loads(moe_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(moe_path)
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (EXPERTS, TOP_K)
    # Every decoder layer is sparse (no dense MLP layers).
    assert config.decoder_sparse_step == 1 and not config.mlp_only_layers


def test_router_statistics_are_transformers_own_routing_of_the_step(moe_path):
    """One step of two micro batches (padded rows of different lengths): ``moe/*`` are the
    routing of the step's real tokens, as transformers reports it, at the weights the step
    started from."""
    config = make_config(moe_path, mbs=4)
    batch = make_batch(8, seed=1)
    expected = transformers_router_metrics(moe_path, batch)
    got = local_policy(config).train(batch, TokenMeanNLL())
    assert_metrics_close(got, expected)
    # Not a degenerate routing: some experts get more than others, none all tokens.
    assert 0 < got["moe/load_cv"] < (EXPERTS / TOP_K - 1) ** 0.5
    assert 1 < got["moe/max_load"] < EXPERTS / TOP_K


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one-process save/load
def test_moe_generates_checkpoints_and_exports(moe_path, tmp_path):
    """Torch generation's logprobs are the trainer's; a checkpoint resumes the same next step;
    the export holds the published per-expert layout and reloads to the same logprobs."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = make_config(moe_path, temperature=0.7, warmup=2)
    config.generation.options["torch"] = TorchGenerationConfig(generation_batch_size=2)
    policy = local_policy(config)
    policy.train(make_batch(8, seed=3), TokenMeanNLL())

    prompts = [[1, 5, 20, 21, 22], [1, 5, 30], [1, 5, 31, 32, 33, 34, 35]]
    out = policy.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.7, seed=5))
    seqs = [p + t for p, t in zip(prompts, out.token_ids, strict=True)]
    lengths = torch.tensor([len(s) for s in seqs])
    lp = policy.get_logprobs(Batch({"input_ids": pad_sequences(seqs), "lengths": lengths}))
    for i, (p, t) in enumerate(zip(prompts, out.token_ids, strict=True)):
        assert len(t) > 0
        got = lp[i, len(p) : len(p) + len(t)]
        torch.testing.assert_close(got, torch.tensor(out.logprobs[i]), rtol=0, atol=1e-5)

    policy.save_checkpoint(str(tmp_path / "ckpt"))
    restored = local_policy(config)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    batch = make_batch(8, seed=4)
    step_a, step_b = policy.train(batch, TokenMeanNLL()), restored.train(batch, TokenMeanNLL())
    assert step_a == step_b and "moe/load_cv" in step_a

    restored.export_hf(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # transformers' published layout: one tensor per expert and projection, no fused ones.
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[:, :-1] / 0.7  # the policy's logprobs are at the temperature
    theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ours = restored.get_logprobs(batch)
    valid = valid_token_mask(batch, ids.shape[1])[:, 1:]
    torch.testing.assert_close(theirs[valid], ours[:, 1:][valid], rtol=0, atol=1e-5)


EXPERT_NAME = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"


@pytest.mark.gpu_sim
@pytest.mark.parametrize("engine", ["vllm-or-sglang", "torch"])
def test_refit_stream_is_in_the_layout_the_engine_loads(moe_path, engine):
    """vLLM's and SGLang's Qwen3-MoE loaders take the checkpoint's per-expert tensors
    (``mlp.experts.{e}.gate_proj.weight``, via ``make_expert_params_mapping``) and cannot
    place transformers' stacked ``mlp.experts.gate_up_proj``: for them (the layout their options
    inherit from ``EngineOptions``) the refit stream is the saved ``model.safetensors``, name
    for name and value for value, each expert once. The torch engine (its options say
    ``in_memory``) gets transformers' own state dict, experts stacked."""
    import re

    from nrl_dtensor.config import TorchGenerationConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from nrl_core.config.schema import EngineOptions

    layout = (
        EngineOptions.weight_layout if engine != "torch" else TorchGenerationConfig.weight_layout
    )
    worker = local_worker(make_config(moe_path))
    sent = [
        item for bucket in worker.state_dict_buckets(1 << 14, layout) for item in bucket.items()
    ]
    names = [name for name, _ in sent]
    assert len(names) == len(set(names))
    if engine == "torch":
        model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
        want = model.state_dict()
    else:
        with safe_open(str(moe_path / "model.safetensors"), "pt") as f:
            want = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        experts = [name for name in names if ".mlp.experts." in name]
        assert all(re.fullmatch(EXPERT_NAME, name) for name in experts)
        assert len(experts) == 2 * EXPERTS * 3  # 2 layers, each expert's 3 projections once
    assert sorted(names) == sorted(want)
    for name, tensor in sent:
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name


@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.gpu_sim
def test_sharded_ranks_stream_the_checkpoint_file_for_vllm_and_sglang(moe_path, start_group):
    """The same stream from 2 ranks with the experts' 3-D weights sharded by FSDP2 (the GPU
    default): each rank's is the saved ``model.safetensors``, name for name and value for
    value, each expert once."""
    from safetensors import safe_open

    from nrl_core.config.schema import EngineOptions

    policy = group_policy(start_group, make_config(moe_path), DTensorConfig(data_parallel="shard"))
    assert policy.group.run_all("is_sharded") == [True, True]
    with safe_open(str(moe_path / "model.safetensors"), "pt") as f:
        want = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for buckets in policy.group.run_all("bucket_list", 1 << 14, EngineOptions.weight_layout):
        sent = [item for bucket in buckets for item in bucket.items()]
        assert sorted(name for name, _ in sent) == sorted(want)
        for name, tensor in sent:
            assert torch.equal(tensor, want[name].to(tensor.dtype)), name


def test_tensor_parallel_is_refused_for_moe_in_one_line(moe_path):
    """The dense TP plan would leave the experts unsharded; the worker says so."""
    from nrl_dtensor.worker import DTensorPolicyWorker, DTensorSetupError

    worker = local_worker(make_config(moe_path))
    with pytest.raises(DTensorSetupError, match="tensor_parallel_size=1"):
        DTensorPolicyWorker._apply_tensor_parallel(worker, worker.model)


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["shard", "replicate"])
def test_two_ranks_with_experts_sharded_match_one_rank(moe_path, start_group, data_parallel):
    """FSDP2 over the experts' 3-D weights on 2 gloo ranks (and replicas): the same step as one
    process; each rank's router statistics cover its own shard, combined as declared (mean of
    the balance, max of the busiest expert's load)."""
    config = make_config(moe_path)
    batch = make_batch(8, seed=1)
    single = local_policy(config)
    expected = single.train(batch, TokenMeanNLL())
    expected_lp = single.get_logprobs(batch)

    options = DTensorConfig(data_parallel=data_parallel)
    policy = group_policy(start_group, config, options)
    assert policy.group.run_all("is_sharded") == [data_parallel == "shard"] * 2
    shards, _ = policy._shards(batch)
    per_rank = [transformers_router_metrics(moe_path, shard) for shard in shards]
    got = policy.train(batch, TokenMeanNLL())
    assert abs(got["loss"] - expected["loss"]) <= 1e-5 * abs(expected["loss"])
    assert abs(got["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"]
    torch.testing.assert_close(policy.get_logprobs(batch), expected_lp, rtol=0, atol=1e-5)
    assert_metrics_close(
        got,
        {
            "moe/load_cv": sum(m["moe/load_cv"] for m in per_rank) / 2,
            "moe/max_load": max(m["moe/max_load"] for m in per_rank),
            "moe/aux_loss": sum(m["moe/aux_loss"] for m in per_rank) / 2,
        },
    )


@pytest.mark.slow
def test_separate_torch_engines_follow_a_moe_refit(moe_path, start_group):
    """Refit of a MoE policy (2 sharded ranks) into separate torch engines: they hold
    the trainer's weights bit for bit and samples what the trainer samples."""
    from test_engine import engines_for

    config = make_config(moe_path)
    policy = group_policy(start_group, config, DTensorConfig(data_parallel="shard"))
    engines = engines_for(config, num_engines=2)  # one per rank: the same seeds
    try:
        policy.train(make_batch(8, seed=1), TokenMeanNLL())
        engines.refit(policy)
        trainer = full_params(policy.group)
        assert any("experts" in name for name in trainer)
        for engine_state in engines.group.run_all("state_dict"):
            assert engine_state.keys() == trainer.keys()
            for name, tensor in trainer.items():
                assert torch.equal(engine_state[name], tensor), name
        prompts = [[1, 5, 20, 21, 22], [1, 5, 30]]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        assert engines.generate(prompts, params).token_ids == (
            policy.generate(prompts, params).token_ids
        )
    finally:
        engines.shutdown()


# -- router replay (R3, issue 52) ---------------------------------------------------------------


def _replay_config(moe_path, *, replay: bool, packing: bool):
    import attrs

    from nrl_core.config.schema import MoeConfig

    config = make_config(moe_path)
    policy = attrs.evolve(
        config.policy,
        sequence_packing=packing,
        moe=MoeConfig(record_routing=True, router_replay=replay),
    )
    return attrs.evolve(config, policy=policy)


def _engine_rollout(config, prompts, seed=3):
    """The torch engine (its own copy of the model) samples continuations and records their
    routing; the rollout batch the core builds from them."""
    from nrl_dtensor.generation import TorchGenerator
    from test_dtensor import context

    from nrl_core.algorithms.rollout import Episode, episodes_to_batch

    engine = TorchGenerator(TorchGenerationConfig(stop_at_eos=False), context(config))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed))
    assert out.routed_experts is not None and out.routing_weights is not None
    episodes = []
    for i, prompt in enumerate(prompts):
        episode = Episode(
            group=i,
            task="t",
            messages=[],
            metadata={},
            token_ids=list(prompt),
            prompt_length=len(prompt),
        )
        episode.append(out.token_ids[i], generated=True, logprobs=out.logprobs[i])
        episode.record_routing(out.routed_experts[i], out.routing_weights[i])
        episodes.append(episode)
    return episodes_to_batch(episodes, torch.zeros(len(prompts)), pad_token_id=0)


def _perturb_routers(worker, scale=0.5, seed=0):
    """Give the trainer's routers other weights than the engine's: it routes many tokens to
    other experts (the train/inference mismatch replay is for; every other weight equal)."""
    from nrl_dtensor.moe import is_router

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in worker.model.modules():
            if is_router(module):
                noise = torch.randn(module.weight.shape, generator=generator)
                module.weight.add_(scale * noise * module.weight.std())


def test_replayed_routing_reproduces_the_torch_engines_logprobs(moe_path):
    """The torch engine records each token's experts and gate weights; a trainer whose routers
    disagree with it (perturbed router weights) computes the engine's logprobs to 1e-5 when
    it replays them (packed micro batches), and differs by far more without replay (the same
    worker, weights and batch)."""
    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.moe import ROUTED_EXPERTS, ROUTING_WEIGHTS
    from nrl_core.policy import Policy

    prompts = [[5, 9, 13, 7], [11, 3], [21, 22, 23, 24, 25, 26], [8]]
    config = _replay_config(moe_path, replay=True, packing=True)
    batch = _engine_rollout(config, prompts)
    assert batch[ROUTED_EXPERTS].shape == (*batch["input_ids"].shape, 2, TOP_K)
    assert batch[ROUTING_WEIGHTS].shape == batch[ROUTED_EXPERTS].shape
    mask = batch["loss_mask"].bool()
    worker = local_worker(config)
    _perturb_routers(worker)
    policy = Policy.from_config(InProcessGroup(worker), config.policy)
    assert policy.packing
    errors = {}
    for replay in (False, True):
        worker.router_replay.replay = replay
        logprobs = policy.get_logprobs(batch)
        errors[replay] = float((logprobs - batch["gen_logprobs"]).abs()[mask].max())
    assert errors[True] <= 1e-5, errors
    assert errors[False] > 1e-3, errors
    # The trainer's own routing disagrees with the engine's on some tokens (measured under
    # replay too: its own top-k, before the engine's replaces it).
    assert 0.0 < policy.train(batch, TokenMeanNLL())["moe/routing_agreement"] < 1.0


def test_replay_without_the_engines_weights_recomputes_them_from_the_router(moe_path):
    """With expert ids but no weights (vLLM's capture) and the trainer's routers equal to the
    engine's, replay (padded micro batches) recomputes the gate weights from the trainer's logits over the replayed
    experts: the logprobs equal the engine's (1e-5), and every token agrees."""
    from nrl_core.moe import ROUTING_WEIGHTS

    config = _replay_config(moe_path, replay=True, packing=False)
    batch = _engine_rollout(config, [[5, 9, 13, 7], [11, 3]])
    del batch.tensors[ROUTING_WEIGHTS]
    policy = local_policy(config)
    logprobs = policy.get_logprobs(batch)
    mask = batch["loss_mask"].bool()
    assert float((logprobs - batch["gen_logprobs"]).abs()[mask].max()) <= 1e-5
    assert policy.train(batch, TokenMeanNLL())["moe/routing_agreement"] == 1.0


def test_router_replay_is_refused_for_a_dense_model(tmp_path):
    from nrl_dtensor.building import DTensorSetupError

    from nrl_core.testing.tiny import tiny_model_path

    dense = tiny_model_path(tmp_path, hidden_size=32, num_layers=1)
    with pytest.raises(DTensorSetupError, match="needs a mixture-of-experts model"):
        local_worker(_replay_config(dense, replay=True, packing=True))
