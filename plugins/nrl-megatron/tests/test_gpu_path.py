"""The megatron policy's GPU path, pinned on CPU (``gpu_sim``): the GPU ``TransformerConfig``
builds a real model, the ``te`` extra reaches the actor venv, refit into a generation endpoint
through the core's ``WeightSender``, offload/onload, and the device choice.

The refit and offload tests run the policy as real Ray actors of the core's ``WorkerGroup`` on
the session's Ray head (``ray_cluster``), as a run does: ``WeightSender`` reaches the engines
through Ray actor handles.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import textwrap
from pathlib import Path

import pytest
import torch
from _megatron_helpers import build_with_gpu_config, requires_megatron

from nrl_core.policy import Policy
from nrl_core.testing.batches import TokenMeanNLL, make_batch

TESTS = Path(__file__).resolve().parent
WORKER = "nrl_megatron.worker:MegatronPolicyWorker"


def _config(path):
    from test_megatron import make_config

    return make_config(path)


def _context(config):
    from nrl_core.interfaces import ComponentContext

    return ComponentContext(config=config, seed=config.seed)


# -- (10) the GPU TransformerConfig -------------------------------------------------------------


@requires_megatron
@pytest.mark.gpu_sim
def test_gpu_transformer_config_builds_the_local_spec_model(tiny_path, pool1, start_group):
    """``persist_layer_norm=True`` (the GPU config before) made ``WrappedTorchNorm`` assert at
    the first layer; the GPU config now builds and runs the whole local-spec model."""
    probe = start_group(pool1, "_megatron_helpers:ParallelStateProbe", (), name="gpu-config")
    out = probe.run_all(build_with_gpu_config, str(tiny_path))[0]
    assert out["use_cpu_initialization"] is False  # the GPU path allocates on the GPU
    assert out["bf16"] is True
    assert out["flags"] == dict.fromkeys(out["flags"], False)
    assert out["param_dtypes"] == {torch.bfloat16}
    assert out["want"].abs().max() > 0.05
    # bfloat16 weights and activations against float32: close, not equal.
    assert (out["got"] - out["want"]).abs().max() < 0.1


# -- (11) the te extra in the actor venv --------------------------------------------------------


def _structured(registry, megatron: dict, **policy):
    """A GRPO config with the megatron policy, structured by the core's config converter (the
    ``policy.megatron`` section becomes the plugin's ``MegatronConfig``)."""
    from nrl_core.config.loader import ConfigConverter
    from nrl_core.config.schema import GRPOConfig

    data = {"policy": {"backend": "megatron", "megatron": megatron, **policy}}
    return ConfigConverter(registry).structure(data, GRPOConfig)


@pytest.mark.gpu_sim
@pytest.mark.parametrize(("te", "extras"), [(True, ("engine", "te")), (False, ("engine",))])
def test_te_extra_reaches_the_actor_venv(te, extras, nrl_registry, monkeypatch):
    """The venv request the core builds the policy's actors from (structured config -> options
    -> extras -> ``request_for``) has ``te`` exactly when ``transformer_engine=true``."""
    from nrl_core.distributed.actor_env import component_extras, request_for
    from nrl_core.preflight import check_component_requirements

    monkeypatch.delenv("NRL_ACTOR_ENV", raising=False)
    monkeypatch.delenv("NRL_ACTOR_VENV_LAYER", raising=False)
    config = _structured(nrl_registry, {"transformer_engine": te})
    spec = nrl_registry.get("policy", "megatron")
    got = component_extras(spec, config.policy.options_for())
    assert got == extras
    assert request_for(spec.distribution, got, spec.plugin).extras == extras
    # The driver's check agrees: the venv will have transformer_engine, nothing to refuse.
    check_component_requirements(config, nrl_registry)


@pytest.mark.gpu_sim
def test_transformer_engine_missing_from_a_system_env_is_one_line(nrl_registry, monkeypatch):
    import importlib.util

    from nrl_core.errors import ConfigError
    from nrl_core.preflight import check_component_requirements

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.fail("this test needs an environment without transformer_engine (CPU CI)")
    monkeypatch.delenv("NRL_ACTOR_ENV", raising=False)
    config = _structured(nrl_registry, {"transformer_engine": True}, actor_env="system")
    with pytest.raises(ConfigError) as error:
        check_component_requirements(config, nrl_registry)
    message = str(error.value)
    assert message.startswith("policy.megatron.transformer_engine=true needs `transformer_engine`")
    assert "nrl-megatron[te]" in message and "\n" not in message


# -- (12) and (4): refit and offload on real Ray actors -----------------------------------------


def _start(target: str, num_workers: int, args: tuple, name: str, layout=None):
    from nrl_core.distributed.worker_group import WorkerGroup

    return WorkerGroup.start(
        target,
        num_workers,
        args=args,
        name=name,
        layout=layout,
        num_cpus_per_worker=0.25,
        timeout_s=300,
        # The loss (TokenMeanNLL) is imported by name in the actors.
        env_vars={"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
    )


@pytest.fixture(scope="module")
def ray_policy(ray_cluster, tiny_path):
    """One megatron policy rank as a Ray actor, trained one step (its weights differ from the
    checkpoint); returns ``(group, policy facade)``."""
    from nrl_megatron.config import MegatronConfig

    from nrl_core.policy import policy_layout

    config = _config(tiny_path)
    options = MegatronConfig()
    group = _start(WORKER, 1, (options, _context(config)), "policy", policy_layout(options))
    policy = Policy.from_config(group, config.policy)
    policy.train(make_batch(8, seed=11), TokenMeanNLL())
    yield group, policy
    group.shutdown()


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@requires_megatron
@pytest.mark.gpu_sim
def test_refit_into_an_engine_endpoint_is_bit_exact(ray_policy, tiny_path, tmp_path):
    """``push_weights`` through the core's ``WeightSender`` (shm transport) into a
    ``StateDictEndpoint`` actor (the reference engine): the endpoint then holds exactly the
    policy's exported Hugging Face weights. Before, the worker had no ``push_weights``."""
    from safetensors.torch import load_file

    from nrl_core.weight_sync import RefitStats, WeightSender

    group, _ = ray_policy
    engine = _start("nrl_core.weight_sync:StateDictEndpoint", 1, (str(tiny_path), 7), "engine")
    try:
        before = engine.run_one(0, "digest")
        results = group.run_all(
            "push_weights", WeightSender(receivers=list(engine.actors)), 64 << 10
        )
        stats = [r for r in results if r is not None]
        assert len(stats) == 1 and isinstance(stats[0], RefitStats)
        assert stats[0].buckets > 1  # several buckets: the bucketing is exercised
        group.run_all("export_hf", str(tmp_path / "hf"))
        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        after = engine.run_one(0, "digest")
        assert after == {name: _sha(t) for name, t in exported.items()}
        assert stats[0].tensors == len(exported)
        assert stats[0].bytes == sum(t.numel() * t.element_size() for t in exported.values())
        checkpoint = load_file(str(Path(tiny_path) / "model.safetensors"))
        # The trained weights arrived, not the checkpoint's, and not the endpoint's own.
        assert after != {name: _sha(t) for name, t in checkpoint.items()}
        assert after != before
    finally:
        engine.shutdown()


@requires_megatron
@pytest.mark.gpu_sim
def test_offload_and_onload_are_cpu_no_ops(ray_policy):
    """The colocated-engine hooks exist and change nothing on CPU: logprobs and the next
    training step are those of a policy that was never offloaded. Unknown parts are refused."""
    from nrl_core.distributed.errors import WorkerError

    group, policy = ray_policy
    batch = make_batch(4, seed=12)
    before = policy.get_logprobs(batch)
    group.run_all("offload", ["optimizer"])
    group.run_all("offload", ["optimizer", "weights"])  # twice: already offloaded is fine
    group.run_all("onload")
    group.run_all("onload")
    torch.testing.assert_close(policy.get_logprobs(batch), before, rtol=0, atol=0)
    with pytest.raises(WorkerError, match="offloads 'optimizer' and 'weights'"):
        group.run_all("offload", ["kv_cache"])


# -- (2) the device choice ----------------------------------------------------------------------


@requires_megatron
@pytest.mark.gpu_sim
def test_the_worker_takes_its_gpu_from_the_core_not_local_rank():
    """Static, because the choice runs only with CUDA (``torch.cuda.set_device``): under Ray
    each rank sees only its own GPU, so ``cuda:LOCAL_RANK`` does not exist on rank 1 of a
    node. The worker must call the core's ``select_cuda_device`` (tested with fake Ray GPUs in
    the core) and never read ``LOCAL_RANK``."""
    from nrl_megatron import worker

    assert "LOCAL_RANK" not in inspect.getsource(worker)
    tree = ast.parse(textwrap.dedent(inspect.getsource(worker.MegatronPolicyWorker)))
    init = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "_init_distributed"
    )
    called = {
        n.func.id
        for n in ast.walk(init)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "select_cuda_device" in called


# -- (13) checkpoints keep the distributed optimizer's parameter state ----------------------------


@requires_megatron
@pytest.mark.gpu_sim
def test_resume_keeps_the_optimizer_state_the_distributed_optimizer_keeps_apart(
    tiny_path, tmp_path, pool1, start_group
):
    """A checkpoint of an optimizer whose ``state_dict()`` omits Adam's moments (as Megatron's
    distributed optimizer's does) still resumes the same update: the moments travel through
    its parameter-state file. Without it, a resume restarts Adam from zero."""
    from _megatron_helpers import checkpoint_through_parameter_state
    from nrl_megatron.config import MegatronConfig

    config = _config(tiny_path)
    batch = make_batch(8, seed=5)
    group = start_group(pool1, WORKER, (MegatronConfig(), _context(config)))
    megatron = Policy.from_config(group, config.policy)
    megatron.train(batch, TokenMeanNLL())  # Adam now has moments
    ckpt = str(tmp_path / "ckpt")
    group.run_all(checkpoint_through_parameter_state, "save_checkpoint", ckpt)
    assert (tmp_path / "ckpt" / "distopt_pp0_tp0_ep0.pt").is_file()
    uninterrupted = megatron.train(batch, TokenMeanNLL())

    group.run_all(checkpoint_through_parameter_state, "load_checkpoint", ckpt)
    resumed = megatron.train(batch, TokenMeanNLL())
    assert resumed == uninterrupted


@requires_megatron
@pytest.mark.gpu_sim
def test_a_checkpoint_before_the_first_optimizer_step_resumes(
    tiny_path, tmp_path, pool1, start_group
):
    """A checkpoint at step 0, when Megatron's distributed optimizer has no state yet (its
    ``state_dict()`` asserts then, and its parameter state has no moments), saves, and loading
    it (into a policy that trained since) resumes exactly the first step: the weights, and an
    optimizer as fresh as it was."""
    from _megatron_helpers import checkpoint_through_parameter_state
    from nrl_megatron.config import MegatronConfig

    config = _config(tiny_path)
    batch = make_batch(8, seed=6)
    group = start_group(pool1, WORKER, (MegatronConfig(), _context(config)))
    megatron = Policy.from_config(group, config.policy)
    ckpt = str(tmp_path / "step0")
    group.run_all(checkpoint_through_parameter_state, "save_checkpoint", ckpt)
    assert not (tmp_path / "step0" / "distopt_pp0_tp0_ep0.pt").exists()  # no state to write
    first = megatron.train(batch, TokenMeanNLL())
    second = megatron.train(batch, TokenMeanNLL())
    assert second != first  # the checkpoint has something to restore

    group.run_all(checkpoint_through_parameter_state, "load_checkpoint", ckpt)
    assert megatron.train(batch, TokenMeanNLL()) == first
    # Adam's moments restarted too: the step after is the second one again.
    assert megatron.train(batch, TokenMeanNLL()) == second


def _stub_worker(**ranks):
    """A megatron policy worker with only its rank attributes set (no model, no process
    group): what naming and picking the parameter-state file read."""
    from nrl_megatron.worker import MegatronPolicyWorker

    worker = object.__new__(MegatronPolicyWorker)
    for name, value in ranks.items():
        setattr(worker, name, value)
    return worker


@pytest.mark.gpu_sim
@pytest.mark.parametrize(
    ("pp", "tp", "ep", "dp"), [(2, 1, 1, 4), (2, 2, 1, 2), (1, 1, 2, 2), (1, 1, 8, 8)]
)
def test_no_two_ranks_write_the_same_distributed_optimizer_file(pp, tp, ep, dp):
    """Megatron's ``ChainedOptimizer.save_parameter_state`` writes on every rank that is
    data-parallel rank 0 of a chained optimizer's group: dense DP rank 0 of each (stage, TP
    rank), and expert-DP rank 0 of each (stage, TP rank, EP rank). Ranks here as Megatron's
    ``tp-cp-ep-dp-pp`` order places them (expert TP = TP, no CP): the TP rank fastest, then
    the data-parallel index, whose EP rank is the fastest part and expert-DP rank the rest.
    No two writers may share a file (a name by TP rank alone had every stage, and at EP=8 every
    rank, write one file, each reading back another's state), and every rank's file is one
    some writer wrote (so the load finds it)."""
    from nrl_core.distributed.worker_group import ParallelLayout

    layout = ParallelLayout(tp=tp, pp=pp, ep=ep)
    world = pp * tp * dp
    assert layout.dp_size(world) == dp
    writers: dict[str, int] = {}
    files = {}
    for rank in range(world):
        dense_dp = layout.dp_rank(rank, world)
        ep_rank = layout.ep_rank(rank, world)
        assert ep_rank == dense_dp % ep  # the EP rank is the fastest part of the DP index
        expert_dp = dense_dp // ep
        worker = _stub_worker(
            pp_rank=layout.pp_rank(rank, world), tp_rank=layout.tp_rank(rank), ep_rank=ep_rank
        )
        files[rank] = worker._parameter_state_file("/ckpt")
        if dense_dp == 0 or expert_dp == 0:
            other = writers.setdefault(files[rank], rank)
            assert other == rank, f"ranks {other} and {rank} both write {files[rank]}"
    assert set(files.values()) == set(writers)


@pytest.mark.gpu_sim
def test_a_checkpoint_with_one_file_per_tp_rank_loads_at_one_stage_and_is_refused_at_two(
    tmp_path,
):
    """Checkpoints written before the per-stage, per-expert-rank names have
    ``distopt_tp{T}.pt``: read at PP=1, EP=1 (one writer per TP rank then), refused in one line
    otherwise (several ranks wrote that file, so what it holds is not this rank's)."""
    from nrl_megatron.worker import MegatronSetupError

    (tmp_path / "distopt_tp0.pt").write_bytes(b"")
    one = _stub_worker(pp_rank=0, tp_rank=0, ep_rank=0, pp_size=1, ep_size=1)
    assert one._parameter_state_to_load(str(tmp_path)) == str(tmp_path / "distopt_tp0.pt")
    for ranks in ({"pp_rank": 1, "pp_size": 2, "ep_size": 1}, {"pp_size": 1, "ep_size": 2}):
        worker = _stub_worker(**{"pp_rank": 0, "tp_rank": 0, "ep_rank": 0, **ranks})
        with pytest.raises(MegatronSetupError, match="tensor-parallel rank only"):
            worker._parameter_state_to_load(str(tmp_path))
    # A file of the current naming wins over an old one.
    (tmp_path / "distopt_pp0_tp0_ep0.pt").write_bytes(b"")
    assert one._parameter_state_to_load(str(tmp_path)).endswith("distopt_pp0_tp0_ep0.pt")


@requires_megatron
@pytest.mark.gpu_sim
def test_resume_from_an_old_named_parameter_state_file_takes_the_same_step(
    tiny_path, tmp_path, pool1, start_group
):
    """The same resume as above from a checkpoint whose parameter state has the name it had
    before (``distopt_tp0.pt``): at one stage without expert parallelism it is still read."""
    from _megatron_helpers import checkpoint_through_parameter_state
    from nrl_megatron.config import MegatronConfig

    config = _config(tiny_path)
    batch = make_batch(8, seed=5)
    group = start_group(pool1, WORKER, (MegatronConfig(), _context(config)))
    megatron = Policy.from_config(group, config.policy)
    megatron.train(batch, TokenMeanNLL())
    ckpt = tmp_path / "ckpt"
    group.run_all(checkpoint_through_parameter_state, "save_checkpoint", str(ckpt))
    (ckpt / "distopt_pp0_tp0_ep0.pt").rename(ckpt / "distopt_tp0.pt")
    uninterrupted = megatron.train(batch, TokenMeanNLL())

    group.run_all(checkpoint_through_parameter_state, "load_checkpoint", str(ckpt))
    assert megatron.train(batch, TokenMeanNLL()) == uninterrupted


# -- issue 34 (1): the tensor-parallel batch check on NCCL ----------------------------------------


@pytest.mark.gpu_sim
def test_tp_batch_digest_is_gathered_on_the_worker_device(monkeypatch):
    """Megatron's tensor-parallel group uses the default backend, NCCL on GPUs, which refuses
    CPU tensors; the digest ``_check_tp_peers_agree`` gathers on every ``forward_backward`` and
    ``compute_logprobs`` must be on the worker's device. The ``meta`` device stands in for the
    GPU (nothing else but the CPU exists here); the fake all-gather refuses any other device as
    NCCL would, then stops the check (meta tensors hold no values to compare)."""
    from types import SimpleNamespace

    from nrl_megatron import worker as megatron_worker

    class Gathered(Exception):
        pass

    worker = SimpleNamespace(tp_size=2, tp_group=object(), device=torch.device("meta"))
    seen = []

    def nccl_like_all_gather(outputs, tensor, group=None):
        assert group is worker.tp_group
        for t in (tensor, *outputs):
            if t.device != worker.device:
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        seen.append((tensor.dtype, tuple(tensor.shape), len(outputs)))
        raise Gathered

    monkeypatch.setattr(megatron_worker.dist, "all_gather", nccl_like_all_gather)
    with pytest.raises(Gathered):
        megatron_worker.MegatronPolicyWorker._check_tp_peers_agree(worker, make_batch(4))
    assert seen == [(torch.long, (4,), 2)]


# -- gpu-review-3 m4: non-finite gradients are not applied on the GPU path ------------------------


class _StubMegatronOptimizer:
    """Megatron's distributed optimizer as ``optimizer_step`` uses it: ``step()`` returns
    ``(success, grad_norm, num_zeros)`` and would apply the update (recorded here)."""

    def __init__(self, grad_norm: float) -> None:
        self.grad_norm = grad_norm
        self.param_groups = [{"lr": 0.0}]
        self.steps = self.zeroed = 0

    def step(self):
        self.steps += 1
        return True, self.grad_norm, 0

    def zero_grad(self):
        self.zeroed += 1


class _StubDDP:
    """Megatron DDP as ``optimizer_step`` uses it: its gradient buffers (``grad_data``)."""

    def __init__(self, grads: torch.Tensor) -> None:
        from types import SimpleNamespace

        self.buffers = [SimpleNamespace(grad_data=grads)]
        self.expert_parallel_buffers = [SimpleNamespace(grad_data=torch.zeros(3))]
        self.synced = self.zeroed = 0

    def finish_grad_sync(self):
        self.synced += 1

    def zero_grad_buffer(self):
        self.zeroed += 1
        for buffer in (*self.buffers, *self.expert_parallel_buffers):
            buffer.grad_data.zero_()


def test_megatron_rate_follows_the_shared_schedule():
    """Megatron sets the rate itself each step: from the same schedule as dtensor's."""
    from types import SimpleNamespace

    from nrl_core.config.schema.policy import OptimizerConfig

    optimizer = OptimizerConfig(lr=1e-3, warmup_steps=1, decay="linear", decay_steps=4)
    worker = _stub_worker(policy=SimpleNamespace(optimizer=optimizer))
    assert [worker._lr(step) for step in range(6)] == pytest.approx(
        [1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0]
    )


def _gpu_path_worker(grads: torch.Tensor, grad_norm: float):
    from types import SimpleNamespace

    from nrl_core.config.schema.policy import OptimizerConfig

    worker = _stub_worker(
        step=0,
        world_size=1,
        device=torch.device("cpu"),
        router_stats=None,
        policy=SimpleNamespace(optimizer=OptimizerConfig(lr=1e-3)),
        model=_StubDDP(grads),
    )
    worker.optimizer = worker.megatron_optimizer = _StubMegatronOptimizer(grad_norm)
    return worker


@pytest.mark.gpu_sim
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gpu_path_skips_the_step_of_non_finite_gradients(bad):
    """A NaN or infinite gradient in Megatron DDP's buffers: Megatron's ``step()`` (which would
    apply it: bfloat16 has no grad scaler, and a NaN clip coefficient clips nothing) is not
    called, the gradients are zeroed, the step is not counted, and ``grad_norm`` says NaN."""
    grads = torch.ones(8)
    grads[5] = bad
    worker = _gpu_path_worker(grads, grad_norm=1.0)
    metrics = worker.optimizer_step()
    assert worker.megatron_optimizer.steps == 0
    assert worker.model.zeroed == 1 and worker.megatron_optimizer.zeroed == 1
    assert not grads.any()
    assert worker.step == 0
    assert metrics["grad_norm"] != metrics["grad_norm"]  # NaN
    assert metrics["lr"] == pytest.approx(1e-3)


@pytest.mark.gpu_sim
def test_gpu_path_skips_a_step_whose_norm_megatron_reports_non_finite():
    """Finite gradients whose norm Megatron reports as NaN (``(True, nan, 0)``): the step is
    not counted and the gradients are zeroed; finite ones step and count."""
    worker = _gpu_path_worker(torch.ones(8), grad_norm=float("nan"))
    metrics = worker.optimizer_step()
    assert worker.megatron_optimizer.steps == 1 and worker.step == 0
    assert worker.model.zeroed == 1
    assert metrics["grad_norm"] != metrics["grad_norm"]

    worker = _gpu_path_worker(torch.ones(8), grad_norm=2.5)
    metrics = worker.optimizer_step()
    assert worker.megatron_optimizer.steps == 1 and worker.step == 1
    assert worker.model.zeroed == 1
    assert metrics["grad_norm"] == 2.5


# -- gpu-review-3 m9: a checkpoint of the other optimizer path is refused in one line -------------


@requires_megatron
@pytest.mark.gpu_sim
def test_a_checkpoint_of_the_other_optimizer_path_is_refused_in_one_line(
    tiny_path, tmp_path, pool1, start_group
):
    """The CPU path's checkpoint (torch.optim state) loaded by the GPU path (Megatron's
    distributed optimizer, as :func:`checkpoint_through_parameter_state` presents it), and the
    reverse: one line naming the path that wrote it, before anything is loaded."""
    from _megatron_helpers import checkpoint_through_parameter_state
    from nrl_megatron.config import MegatronConfig

    config = _config(tiny_path)
    group = start_group(pool1, WORKER, (MegatronConfig(), _context(config)))
    megatron = Policy.from_config(group, config.policy)
    batch = make_batch(8, seed=5)
    megatron.train(batch, TokenMeanNLL())
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    group.run_all("save_checkpoint", cpu)
    group.run_all(checkpoint_through_parameter_state, "save_checkpoint", gpu)
    saved = megatron.get_logprobs(batch)
    megatron.train(batch, TokenMeanNLL())  # the weights now differ from the checkpoints'
    logprobs = megatron.get_logprobs(batch)
    assert (logprobs - saved).abs().max() > 1e-4

    with pytest.raises(
        RuntimeError,
        match=r"MegatronSetupError: checkpoint .*cpu was written by "
        r"the megatron policy's CPU path .*; resume it on CPU",
    ):
        group.run_all(checkpoint_through_parameter_state, "load_checkpoint", cpu)
    with pytest.raises(
        RuntimeError,
        match=r"MegatronSetupError: checkpoint .*gpu was written by "
        r"the megatron policy's GPU path .*; resume it on a GPU",
    ):
        group.run_all("load_checkpoint", gpu)
    # Refused before anything was loaded: the weights are still the trained ones.
    torch.testing.assert_close(megatron.get_logprobs(batch), logprobs, rtol=0, atol=0)
    group.run_all("load_checkpoint", cpu)  # the path that wrote it loads it
    torch.testing.assert_close(megatron.get_logprobs(batch), saved, rtol=0, atol=0)


# -- gpu-review-3 m8: one tensor-parallel batch check per call, not per micro batch ---------------


def _tp_worker(monkeypatch, peer_offset: int = 0):
    """A TP=2 worker stub whose all-gather (counted) hands back this rank's digest as the
    peer's, plus ``peer_offset`` on its last entry (a peer that saw other tokens)."""
    from types import SimpleNamespace

    from nrl_megatron import worker as megatron_worker

    gathers = []

    def all_gather(outputs, tensor, group=None):
        gathers.append(tensor.numel())
        outputs[0].copy_(tensor)
        outputs[1].copy_(tensor)
        outputs[1][-1] += peer_offset

    monkeypatch.setattr(megatron_worker.dist, "all_gather", all_gather)
    model = SimpleNamespace(train=lambda: None, eval=lambda: None)
    worker = _stub_worker(
        tp_size=2, tp_group=object(), device=torch.device("cpu"), pp_size=1, model=model
    )
    worker.router_stats = None
    worker.ran = []
    worker._logprobs = lambda model, micro_batch: torch.zeros(micro_batch["input_ids"].shape)
    worker._forward_backward = lambda micro_batch, loss: worker.ran.append(len(micro_batch))
    return worker, gathers


@pytest.mark.gpu_sim
def test_tp_batch_check_runs_once_per_call(monkeypatch):
    """A step's or a logprob pass's micro batches are checked with ONE all-gather (four values
    per micro batch), not one all-gather (and device syncs) per micro batch."""
    micro_batches = list(make_batch(6, seed=2).micro_batches(2))
    worker, gathers = _tp_worker(monkeypatch)

    def loss(logprobs):
        return logprobs.sum().requires_grad_()

    assert worker.forward_backward_micro_batches([(mb, loss) for mb in micro_batches])
    assert gathers == [12]
    assert worker.ran == [2, 2, 2]
    assert len(worker.compute_logprobs_micro_batches(micro_batches)) == 3
    assert gathers == [12, 12]


@pytest.mark.gpu_sim
def test_tp_batch_check_still_refuses_peers_with_other_batches(monkeypatch):
    from nrl_megatron.worker import MegatronSetupError

    micro_batches = list(make_batch(6, seed=2).micro_batches(2))
    worker, _ = _tp_worker(monkeypatch, peer_offset=1)  # the last micro batch differs
    with pytest.raises(MegatronSetupError, match="tensor-parallel peers received different"):
        worker.forward_backward_micro_batches([(mb, None) for mb in micro_batches])
    assert worker.ran == []  # refused before any forward
