"""The megatron policy on CPU: real Megatron-Core modules over real gloo ranks.

Every Megatron object lives in spawned ranks (see conftest.py). Tolerances, float32 on CPU:
Megatron vs Hugging Face logits within 1e-5 absolute (observed: 0.0 — same SDPA kernel, and a
fused QKV matmul computes each output element like the separate ones); losses and gradient
norms within 1e-5 relative, logprobs 1e-5 absolute, as in the dtensor tests.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import assert_every_rank_streams_the_checkpoint, requires_megatron

from nrl_core.config.schema import GenerationConfig, GRPOConfig, OptimizerConfig, PolicyConfig
from nrl_core.distributed.worker_group import InProcessGroup
from nrl_core.interfaces import ComponentContext
from nrl_core.policy import Policy
from nrl_core.testing.batches import NaNLoss, TokenMeanNLL, make_batch

pytestmark = requires_megatron

WORKER = "nrl_megatron.worker:MegatronPolicyWorker"


def make_config(path, *, mbs=4, lr=1e-3, temperature=1.0, warmup=0):
    policy = PolicyConfig(
        backend="megatron",
        model_name=str(path),
        train_micro_batch_size=mbs,
        logprob_batch_size=4,
        max_grad_norm=1.0,
        optimizer=OptimizerConfig(name="adamw", lr=lr, warmup_steps=warmup),
    )
    return GRPOConfig(seed=0, policy=policy, generation=GenerationConfig(temperature=temperature))


def context(config):
    return ComponentContext(config=config, seed=config.seed)


def megatron_options(tp=1):
    from nrl_megatron.config import MegatronConfig

    return MegatronConfig(tensor_model_parallel_size=tp)


def dtensor_worker(config):
    """The single-process dtensor policy (the reference implementation) in this process."""
    # The reference implementation; the plugin-megatron nox session installs it beside this
    # plugin (without dependencies) for exactly this comparison.
    pytest.importorskip("nrl_dtensor", reason="nrl-dtensor not installed for the comparison")
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    return DTensorPolicyWorker(DTensorConfig(), context(config))


@pytest.mark.parametrize("model", ["tiny_path", "tiny_qwen2_path"])
def test_forward_matches_hugging_face(model, request, pool1, start_group):
    path = str(request.getfixturevalue(model))
    ids = torch.randint(7, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    probe = start_group(pool1, "_megatron_helpers:ForwardProbe", (path,), name="probe")
    megatron_logits, hf_logits = probe.run_all("logits", ids)[0]
    assert hf_logits.abs().max() > 0.05  # a real signal, not an all-zero output
    torch.testing.assert_close(megatron_logits, hf_logits, rtol=0, atol=1e-5)


def test_forward_negative_control_naive_qkv_differs(tiny_path, pool1, start_group):
    # Proves the forward comparison can fail: un-interleaved QKV gives different logits.
    ids = torch.randint(7, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    probe = start_group(
        pool1, "_megatron_helpers:ForwardProbe", (str(tiny_path), "naive_qkv"), name="bad"
    )
    megatron_logits, hf_logits = probe.run_all("logits", ids)[0]
    assert (megatron_logits - hf_logits).abs().max() > 1e-3


def policy(group, config) -> Policy:
    """The core's policy facade (the training step every run uses) over a test group."""
    return Policy.from_config(group, config.policy)


def assert_one_step_matches_dtensor(config, pool1, start_group):
    """One training step of a one-rank Megatron policy against the dtensor policy on the same
    batch: logprobs before and after, loss, NLL sum, tokens and grad norm; return ``(megatron
    policy, batch, dtensor's logprobs before the step, megatron's step metrics, dtensor's)``."""
    batch = make_batch(8, seed=1)
    reference = Policy.from_config(InProcessGroup(dtensor_worker(config)), config.policy)
    want_lp = reference.get_logprobs(batch)
    want = reference.train(batch, TokenMeanNLL())
    want_after = reference.get_logprobs(batch)

    megatron = policy(start_group(pool1, WORKER, (megatron_options(), context(config))), config)
    got_lp = megatron.get_logprobs(batch)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    got = megatron.train(batch, TokenMeanNLL())
    for key in ("loss", "nll_sum", "tokens", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    got_after = megatron.get_logprobs(batch)
    assert (got_after - got_lp).abs().max() > 1e-4  # the step changed the model
    torch.testing.assert_close(got_after, want_after, rtol=0, atol=1e-4)
    return megatron, batch, want_lp, got, want


def assert_refit_into_the_torch_engine_gives_the_trainers_logprobs(
    config, prompts, pool1, start_group
):
    """After a training step the one-rank Megatron policy's refit stream (Hugging Face names,
    experts stacked) goes into a separate torch engine holding the initial weights: every
    parameter is written (``finish_weight_update`` refuses a refit that left one out), and the
    engine's logprobs of its greedy continuations of ``prompts`` equal the trainer's (1e-5)."""
    pytest.importorskip("nrl_dtensor", reason="nrl-dtensor not installed for the torch engine")
    from _megatron_helpers import sequences_batch
    from nrl_dtensor.config import TorchGenerationConfig
    from nrl_dtensor.engine import TorchEngine

    from nrl_core.interfaces import SamplingParams
    from nrl_core.weight_sync.shm import send_shm

    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    megatron = policy(group, config)
    megatron.train(make_batch(8, seed=1), TokenMeanNLL())

    engine = TorchEngine(TorchGenerationConfig(colocated=False), context(config))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(prompts, greedy)
    engine.begin_weight_update()
    for bucket in group.run_all("state_dict_buckets", 1 << 16)[0]:
        send_shm(bucket, engine.receive_bucket, lambda received: received)
    engine.finish_weight_update()
    after = engine.generate(prompts, greedy)
    assert after.token_ids != before.token_ids or after.logprobs != before.logprobs

    trainer = megatron.get_logprobs(sequences_batch(prompts, after.token_ids))
    for row, (prompt, logprobs) in enumerate(zip(prompts, after.logprobs, strict=True)):
        want = trainer[row, len(prompt) : len(prompt) + len(logprobs)]
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=0, atol=1e-5)


def test_train_step_matches_dtensor(tiny_path, pool1, start_group):
    config = make_config(tiny_path, temperature=0.7)
    megatron, batch, want_lp, got, want = assert_one_step_matches_dtensor(
        config, pool1, start_group
    )
    assert got["lr"] == want["lr"]
    # The reference stays at the initial weights.
    torch.testing.assert_close(
        megatron.get_logprobs(batch, reference=True), want_lp, rtol=0, atol=1e-5
    )


def test_a_nan_gradient_is_never_applied(tiny_path, pool1, start_group):
    """Issue 40, as with dtensor: a step whose gradients are NaN reports grad_norm NaN and leaves
    the weights as they were; the next finite step trains like a fresh policy's first."""
    import math

    from nrl_core.errors import NonFiniteError

    config = make_config(tiny_path)
    batch = make_batch(8, seed=2)
    megatron = policy(start_group(pool1, WORKER, (megatron_options(), context(config))), config)
    before = megatron.get_logprobs(batch)
    try:
        metrics = megatron.train(batch, NaNLoss())
        assert not math.isfinite(metrics["grad_norm"])
    except NonFiniteError:
        pass  # the core may stop at the non-finite norm itself
    after = megatron.get_logprobs(batch)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    expected = dtensor_worker(config)
    want = Policy.from_config(InProcessGroup(expected), config.policy).train(batch, TokenMeanNLL())
    got = megatron.train(batch, TokenMeanNLL())
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_reported_loss_is_the_computed_loss(tiny_path, pool2, start_group):
    """The reported ``loss`` is the token-mean NLL the step back-propagated, counted once (the
    loss function's own ``loss`` metric is not added to it), over 2 ranks x 2 micro batches."""
    config = make_config(tiny_path, mbs=2)
    batch = make_batch(8, seed=5)
    megatron = policy(start_group(pool2, WORKER, (megatron_options(), context(config))), config)
    before = megatron.get_logprobs(batch)
    mask = batch["loss_mask"] * batch["sample_mask"][:, None]
    computed = float(-(before * mask).sum() / mask.sum())
    got = megatron.train(batch, TokenMeanNLL())
    assert got["loss"] == pytest.approx(computed, rel=1e-5)
    assert got["tokens"] == float(mask.sum())


def test_reference_snapshot(tiny_path, tmp_path, pool1, start_group):
    config = make_config(tiny_path)
    batch = make_batch(8, seed=6)
    megatron = policy(start_group(pool1, WORKER, (megatron_options(), context(config))), config)
    megatron.train(batch, TokenMeanNLL())
    trained = megatron.get_logprobs(batch)
    megatron.snapshot_reference(str(tmp_path / "reference"))
    megatron.train(batch, TokenMeanNLL())
    torch.testing.assert_close(
        megatron.get_logprobs(batch, reference=True), trained, rtol=0, atol=1e-5
    )
    assert (megatron.get_logprobs(batch) - trained).abs().max() > 1e-4


@pytest.mark.parametrize("tp", [2, 1])
def test_two_ranks_match_one_rank(tp, tiny_path, pool1, pool2, start_group):
    """TP=2 (both ranks get the whole batch) or DP=2 (each gets half) vs one rank."""
    config = make_config(tiny_path)
    batch = make_batch(8, seed=2)
    single = policy(
        start_group(pool1, WORKER, (megatron_options(), context(config)), name="single"), config
    )
    want = single.train(batch, TokenMeanNLL())
    want_lp = single.get_logprobs(batch)

    group = start_group(pool2, WORKER, (megatron_options(tp), context(config)))
    # Before training, the streamed export (TP shards gathered, converted back to HF names)
    # is bit-identical to the checkpoint on every rank.
    assert_every_rank_streams_the_checkpoint(group, tiny_path)

    got = policy(group, config).train(batch, TokenMeanNLL())
    for key in ("loss", "nll_sum", "tokens", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    torch.testing.assert_close(
        policy(group, config).get_logprobs(batch), want_lp, rtol=0, atol=1e-5
    )


def test_tp_peers_with_different_batches_are_refused(tiny_path, pool2, start_group):
    config = make_config(tiny_path)
    group = start_group(pool2, WORKER, (megatron_options(2), context(config)))
    with pytest.raises(RuntimeError, match="tensor-parallel peers received different batches"):
        # Each rank its own micro batch, bypassing the data-parallel mapping on purpose.
        shards = make_batch(4, seed=3).shard(2)
        group.pool._call("call", group.key, [("compute_logprobs", (s,)) for s in shards])


def test_checkpoint_and_export_round_trip(tiny_path, tmp_path, pool1, start_group):
    from transformers import AutoModelForCausalLM

    config = make_config(tiny_path)
    batch = make_batch(8, seed=4)
    megatron = policy(start_group(pool1, WORKER, (megatron_options(), context(config))), config)
    megatron.train(batch, TokenMeanNLL())
    megatron.save_checkpoint(str(tmp_path / "ckpt"))
    after_save = megatron.get_logprobs(batch)
    second = megatron.train(batch, TokenMeanNLL())

    megatron.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(megatron.get_logprobs(batch), after_save, rtol=0, atol=0)
    again = megatron.train(batch, TokenMeanNLL())
    assert again == second  # optimizer state and step restored: the same update again

    megatron.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = batch["input_ids"][:, :6]
    with torch.no_grad():
        lp = torch.log_softmax(exported(input_ids=ids).logits[:, :-1], -1)
    hf_lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(hf_lp, megatron.get_logprobs(batch)[:, 1:6], rtol=0, atol=1e-5)


def test_unsupported_parallel_sizes_are_user_errors(tiny_path, pool1, start_group):
    from nrl_megatron.config import MegatronConfig

    config = make_config(tiny_path)
    with pytest.raises(RuntimeError, match=r"MegatronSetupError.*pipeline_model_parallel_size"):
        start_group(
            pool1, WORKER, (MegatronConfig(pipeline_model_parallel_size=2), context(config))
        )


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the shape of every pickle exploit."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_in_a_rank_file_does_not_run(tiny_path, tmp_path, pool1, start_group):
    config = make_config(tiny_path)
    group = start_group(pool1, WORKER, (megatron_options(), context(config)))
    checkpoint = tmp_path / "ckpt"
    group.run_all("save_checkpoint", str(checkpoint))
    marker = tmp_path / "pwned"
    torch.save({"model": _RunsCode(str(marker))}, checkpoint / "rank0.pt")
    # One line naming the file and what it refers to (safe_pickle.torch_load_data), issue 40;
    # Python 3.12 pickles io.open under its defining module, _io.
    with pytest.raises(
        RuntimeError, match=r"rank0\.pt refers to _?io\.open, which nrl does not load"
    ):
        group.run_all("load_checkpoint", str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran code from it"
