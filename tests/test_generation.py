"""Separate generation engines on GPUs, as the run session places and drives them: colocated
engines share the policy's GPUs (and its memory, handed over around every refit and
generation), tensor-parallel engines get their GPUs in one bundle.

The session's Ray head has 4 logical GPUs (``ray_cluster``): Ray schedules and narrows
``CUDA_VISIBLE_DEVICES`` as on a GPU node. The engines and policy ranks are the recording
workers of :mod:`nrl_core.testing.recording` (vLLM and SGLang cannot run here), started by the
session's own methods; the refit between them is real (shared memory).
"""

from __future__ import annotations

import contextlib

import pytest
from rich.console import Console

from nrl_core import hookimpl
from nrl_core.algorithms.runtime import RunSession
from nrl_core.config.schema import (
    ClusterConfig,
    GenerationConfig,
    GRPOConfig,
    LoggerConfig,
    PolicyConfig,
)
from nrl_core.errors import NrlError
from nrl_core.interfaces import SamplingParams
from nrl_core.testing.recording import RecordingEngineConfig

pytestmark = pytest.mark.gpu_sim


class RecordingPlugin:
    @hookimpl
    def nrl_register_policies(self, register):
        register("recording", "nrl_core.testing.recording:RecordingPolicyWorker")

    @hookimpl
    def nrl_register_generations(self, register):
        register(
            "recording",
            "nrl_core.testing.recording:RecordingEngineWorker",
            config="nrl_core.testing.recording:RecordingEngineConfig",
        )


@pytest.fixture
def registry(plugin_host):
    plugin_host.add(RecordingPlugin(), "recording-test-plugin")
    return plugin_host.registry()


def _session(tmp_path, registry, engine: RecordingEngineConfig, policy_ranks: int = 2):
    config = GRPOConfig(
        policy=PolicyConfig(backend="recording", num_workers=policy_ranks),
        generation=GenerationConfig(backend="recording", options={"recording": engine}),
        cluster=ClusterConfig(worker_timeout_s=45),
        logger=LoggerConfig(log_dir=str(tmp_path)),
    )
    return RunSession(config, registry, algorithm="grpo", console=Console(quiet=True))


def _start(session, resources):
    """What the run's set-up (``Components.start``) does for the policy and the generation
    engines."""
    session.cluster_resources = resources
    shared = session.components.colocation_bundles(resources)
    if shared is not None:
        session.generate, session.refit = session.components.generation_backend(shared)
    session.policy = session.components.start_policy(resources, 0.0, shared)
    if shared is None:
        session.generate, session.refit = session.components.generation_backend(None)
    session.gate = session.components.weight_gate()
    session.generate = session.gate.generate
    return session.policy, session.generation_engines


def test_colocated_engines_start_and_share_each_policy_rank_gpu(ray_cluster, registry, tmp_path):
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=2))
    try:
        policy, engines = _start(session, resources)  # on 6afd7ff: pending until the timeout
        policy_gpus = [w["CUDA_VISIBLE_DEVICES"] for w in policy.group.run_all("where")]
        engine_gpus = [w["CUDA_VISIBLE_DEVICES"] for w in engines.group.run_all("where")]
        assert engine_gpus == policy_gpus  # engine r on the GPU of policy rank r
        assert len(set(policy_gpus)) == 2 and all(g and "," not in g for g in policy_gpus)
        assert engines.colocated
    finally:
        session.close()


def _timeline(policy, engines) -> list[str]:
    events = [
        (t, f"policy:{name}", detail) for t, name, detail in policy.group.run_one(0, "events")
    ]
    events += [(t, f"engine:{name}", d) for t, name, d in engines.group.run_one(0, "events")]
    return [
        name + (f"{detail}" if name == "policy:offload" else "")
        for _, name, detail in sorted(events, key=lambda e: e[0])
    ]


def test_the_policy_hands_its_gpu_memory_to_colocated_engines_and_takes_it_back(
    ray_cluster, registry, tmp_path
):
    """The engines sleep once the policy needs its GPU again, not after each generate: two
    generate calls (two turns) run on one refit's weights, and the policy's next call puts
    the engines to sleep before its weights come back."""
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=2))
    try:
        policy, engines = _start(session, resources)
        session.refit()
        out = session.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
        assert out.token_ids == [[3, 2, 1], [5, 4]]
        session.generate([[6]], SamplingParams(max_new_tokens=1))  # a second turn
        policy.set_reference(str(tmp_path / "ref"))  # the policy's next call: weights back
        # A validation pass after training: its refit, then its generate.
        session.refit()
        session.generate([[7]], SamplingParams(max_new_tokens=1))

        timeline = _timeline(policy, engines)
        assert timeline == [
            "engine:sleep",  # start-up: the policy owns the GPU until the first refit
            "policy:offload['optimizer']",  # room for the engine's weights
            "policy:push_weights",
            "engine:begin_weight_update",
            "engine:receive_bucket",
            "engine:finish_weight_update",
            "policy:offload['weights']",  # room for the engine's KV cache
            "engine:generate",
            "engine:generate",  # the same weights, still awake
            "engine:sleep",  # the policy takes its GPU back
            "policy:onload",
            "policy:set_reference",
            "policy:offload['optimizer']",
            "policy:push_weights",
            "engine:begin_weight_update",
            "engine:receive_bucket",
            "engine:finish_weight_update",
            "policy:offload['weights']",
            "engine:generate",
        ], timeline
        weights = engines.group.run_one(0, "weights")
        assert weights["model.embed.weight"] == [float(i) for i in range(12)]
        assert weights["model.head.bias"] == [0.5] * 5
    finally:
        session.close()


def test_a_tensor_parallel_engine_holds_all_its_gpus_in_one_actor(ray_cluster, registry, tmp_path):
    _, resources = ray_cluster
    session = _session(
        tmp_path, registry, RecordingEngineConfig(tensor_parallel_size=2), policy_ranks=1
    )
    try:
        policy, engines = _start(session, resources)
        (engine,) = engines.group.run_all("where")
        (rank,) = policy.group.run_all("where")
        engine_gpus = engine["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(engine_gpus) == 2 and sorted(engine_gpus) == sorted(engine["ray_gpu_ids"])
        assert rank["CUDA_VISIBLE_DEVICES"] not in engine_gpus  # its own GPUs, not the policy's
        assert not engines.colocated
    finally:
        session.close()


# -- B2 (docs/gpu review 3): colocated engines dropped their weights after every generate ------

DROPPED = r"do not hold weights \(colocated ones dropped them when they last slept"
"""The refusal to generate on engines whose sleep dropped their weights (GenerationEngines)."""


class _CountdownPool:
    """The core's environment pool around one in-process
    :class:`~nrl_core.testing.environments.CountdownEnvironment` (2 turns)."""

    def __init__(self) -> None:
        from nrl_core.testing.environments import CountdownEnvironment

        self.env = CountdownEnvironment(turns=2)

    def step(self, tasks, conversations, metadata):
        from nrl_core.environments import StepResult

        return [StepResult(step) for step in self.env.step(conversations, metadata)]

    def defines_correctness(self, task):
        return False

    def metrics(self, task, data):
        return {}


def _grpo_run(session, tmp_path, **grpo):
    """GRPO's own loop (``GRPOTrainer.fit``: validation, steps, rollouts, the gate's refits)
    over the session's recording engines and policy; training is one policy call that takes
    the GPU back (as the logprob pass does first). Returns what each step logged."""
    from types import SimpleNamespace

    from nrl_core.agents import BUILTIN_AGENT
    from nrl_core.algorithms.grpo import GRPOTrainer
    from nrl_core.algorithms.rollout import ChatCodec
    from nrl_core.config.schema import GRPOConfig
    from nrl_core.data import Sample
    from nrl_core.testing.tokenizers import bpe_tokenizer

    config = GRPOConfig()
    config.generation.max_new_tokens = 8
    config.grpo.num_prompts_per_step = 2
    config.grpo.num_generations_per_prompt = 2
    config.grpo.max_rollout_turns = 2
    config.logger.sample_period = 0
    for key, value in grpo.items():
        setattr(config.grpo, key, value)
    tokenizer = bpe_tokenizer()
    samples = [Sample(messages=[{"role": "user", "content": f"{i}+{i}?"}]) for i in range(40)]

    class Stream:
        def take(self, n):
            return [samples.pop() for _ in range(n)]

    logged = []
    run = SimpleNamespace(
        config=config,
        start_step=0,
        gate=session.gate,
        generate=session.gate.generate,
        policy=session.policy,
        train_stream=Stream(),
        val_samples=samples[:2],
        tokenizer=tokenizer,
        codec=ChatCodec(tokenizer),
        env_pool=_CountdownPool(),
        agent_for=lambda task: BUILTIN_AGENT,
        log=lambda step, metrics: logged.append((step, dict(metrics))),
        progress=lambda *a, **k: contextlib.nullcontext(lambda metrics: None),
        phase=lambda words: contextlib.nullcontext(lambda words: None),
        should_checkpoint=lambda step, last: False,
        summary=lambda: None,
        _environment_routes=lambda: {"default": ("countdown", "env.name")},
    )

    class Trainer(GRPOTrainer):
        def train_on(self, step, data, *, step_start, refit_s, generation_s=None):
            session.policy.set_reference(str(tmp_path / f"step{step}"))
            return {"train/turns": float(sum(e.turns for e in data.episodes))}

    assert Trainer(run).fit() == 0
    return logged


def _generates_and_refits(engines) -> list[str]:
    names = [name for _, name, _ in engines.group.run_one(0, "events")]
    return [n for n in names if n in ("generate", "sleep", "finish_weight_update")]


def test_grpo_with_validation_and_two_turns_never_generates_on_dropped_weights(
    ray_cluster, registry, tmp_path
):
    """2 GRPO steps, ``val_period=1``, a 2-turn environment, colocated engines whose sleep
    drops the weights (vLLM level 2; the recording engine raises MemoryContractError on a
    generate before the next refit). Before the fix the engines slept after every generate:
    the second turn generated on dropped weights, and so did step 1 after the validation of
    step 0 (the gate still held version 0 and skipped the refit)."""
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=2))
    try:
        _, engines = _start(session, resources)
        logged = _grpo_run(session, tmp_path, max_num_steps=2, val_period=1)
        assert [step for step, _ in logged] == [0, 1, 2]
        assert all(m["train/turns"] == 8.0 for step, m in logged if step > 0)  # 4 x 2 turns
        assert all(m["val/turns_mean"] == 2.0 for _, m in logged)
        events = _generates_and_refits(engines)
        # Validation k refits (weights of step k) and runs two turns; step k + 1 generates on
        # those weights, still awake (no policy call between: no sleep, no refit); its
        # training puts the engine to sleep, and the next validation refits.
        turns = ["generate", "generate"]
        assert events == [
            "sleep",  # start-up
            *["finish_weight_update", *turns, *turns],  # validation 0, step 1's rollouts
            "sleep",  # step 1 trains
            *["finish_weight_update", *turns, *turns],  # validation 1, step 2's rollouts
            "sleep",  # step 2 trains
            *["finish_weight_update", *turns],  # validation 2
        ], events
    finally:
        session.close()


def test_dynamic_sampling_rounds_generate_on_one_refit(ray_cluster, registry, tmp_path):
    """DAPO's extra rounds (no reward variance: the recording engine answers a group alike)
    generate again before any training: on the same weights, without a sleep between."""
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=1))
    try:
        _, engines = _start(session, resources)
        logged = _grpo_run(
            session,
            tmp_path,
            max_num_steps=1,
            val_period=0,
            max_rollout_turns=1,
            dynamic_sampling=True,
            dynamic_sampling_max_batches=2,
        )
        assert logged[-1][1].get("train/skipped_no_signal") == 1.0
        events = _generates_and_refits(engines)
        assert events == ["sleep", "finish_weight_update", "generate", "generate", "generate"]
    finally:
        session.close()


def test_generate_after_a_weight_dropping_sleep_needs_a_refit(ray_cluster, registry, tmp_path):
    """The core's own check: once the engines slept with their weights dropped, generate
    refuses before calling any engine, and the gate refits for the version it already had."""
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=1))
    try:
        policy, engines = _start(session, resources)
        params = SamplingParams(max_new_tokens=1)
        with pytest.raises(NrlError, match=DROPPED):
            session.generate([[1]], params)  # asleep since start-up, never refitted
        assert session.gate.ensure(0) > 0 and engines.holds_weights
        session.generate([[1]], params)
        assert session.gate.ensure(0) == 0.0  # still awake, same weights: no refit
        policy.set_reference(str(tmp_path / "ref"))  # the policy takes its GPU back
        assert not engines.holds_weights
        with pytest.raises(NrlError, match=DROPPED):
            session.generate([[1]], params)
        assert session.gate.ensure(0) > 0  # the same version, refitted: the weights were lost
        session.generate([[1]], params)
        # The engine itself keeps the contract too: a generate that slipped past the core.
        engines.release()
        with pytest.raises(Exception, match="generate on weights dropped"):
            engines.group.run_all("generate", [[1]], params)
    finally:
        session.close()


# -- the refit transport (GPU review 3, m5) ----------------------------------------------------


def test_nccl_refit_into_colocated_engines_on_gpus_is_refused():
    from nrl_core.errors import ConfigError
    from nrl_core.generation import resolve_transport

    with pytest.raises(ConfigError) as error:
        resolve_transport("nccl", colocated=True, on_gpu=True, section="generation.vllm")
    message = str(error.value)
    assert "\n" not in message
    assert "generation.vllm.refit_transport=nccl with generation.vllm.colocated=true" in message
    # What stays allowed: separate GPUs, and CPU (nothing is shared there).
    assert resolve_transport("nccl", colocated=False, on_gpu=True) == "nccl"
    assert resolve_transport("nccl", colocated=True, on_gpu=False) == "nccl"
    assert resolve_transport("auto", colocated=True, on_gpu=True) == "cuda_ipc"
