"""Separate generation engines on GPUs, as the run session places and drives them: colocated
engines share the policy's GPUs (and its memory, handed over around every refit and
generation), tensor-parallel engines get their GPUs in one bundle.

The session's Ray head has 4 logical GPUs (``ray_cluster``): Ray schedules and narrows
``CUDA_VISIBLE_DEVICES`` as on a GPU node. The engines and policy ranks are the recording
workers of :mod:`nrl_core.testing.recording` (vLLM and SGLang cannot run here), started by the
session's own methods; the refit between them is real (shared memory).
"""

from __future__ import annotations

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
    _, resources = ray_cluster
    session = _session(tmp_path, registry, RecordingEngineConfig(colocated=True, num_engines=2))
    try:
        policy, engines = _start(session, resources)
        session.refit()
        out = session.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
        assert out.token_ids == [[3, 2, 1], [5, 4]]
        policy.set_reference(str(tmp_path / "ref"))  # the policy's next call: weights back
        # A validation pass after training, then the next step's refit.
        session.generate([[7]], SamplingParams(max_new_tokens=1))
        session.refit()

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
            "engine:sleep",
            "policy:onload",
            "policy:set_reference",
            "policy:offload['optimizer', 'weights']",
            "engine:generate",
            "engine:sleep",
            "policy:onload",  # the push needs the weights on the GPU
            "policy:offload['optimizer']",
            "policy:push_weights",
            "engine:begin_weight_update",
            "engine:receive_bucket",
            "engine:finish_weight_update",
            "policy:offload['weights']",
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
