"""Separate torch engines (``generation.torch.colocated=false``): the engine-side path that
vLLM and SGLang take (own weights, refit through shared memory), run for real on CPU."""

from __future__ import annotations

import pytest
import torch
from nrl_dtensor.config import DTensorConfig, TorchGenerationConfig
from test_dtensor import WORKER, context, full_params, make_config

from nrl_core.generation import start_generation_engines
from nrl_core.interfaces import SamplingParams
from nrl_core.policy import Policy
from nrl_core.registry import ComponentSpec
from nrl_core.testing.batches import TokenMeanNLL, make_batch

PROMPTS = [[1, 5, 20, 21, 22], [1, 5, 30], [1, 5, 31, 32, 33, 34, 35], [1, 7, 8]]


def engines_for(config, num_engines: int):
    config.generation.options["torch"] = TorchGenerationConfig(
        colocated=False, num_engines=num_engines
    )
    spec = ComponentSpec(
        kind="generation", name="torch", target="nrl_dtensor.engine:TorchEngine", plugin="test"
    )
    return start_generation_engines(spec, config, on_gpu=False, timeout_s=300)


@pytest.fixture
def setup(tiny_path, start_group):
    config = make_config(tiny_path)
    group = start_group(WORKER, (DTensorConfig(), context(config)))
    engines = engines_for(config, num_engines=2)
    yield config, Policy.from_config(group, config.policy), group, engines
    engines.shutdown()


def test_engines_sample_what_colocated_generation_samples_and_follow_refits(setup):
    """Two engines and two colocated ranks, same weights and seeds: the same samples. After a
    training step and a refit, the engines hold the trainer's weights bit for bit, and sample
    what the trainer's ranks now sample."""
    _, policy, group, engines = setup
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    for p in (params, greedy):
        assert engines.generate(PROMPTS, p).token_ids == policy.generate(PROMPTS, p).token_ids

    policy.train(make_batch(8, seed=1), TokenMeanNLL())
    before = engines.generate(PROMPTS, greedy)
    seconds = engines.refit(policy)
    stats = engines.last_refit
    trainer = full_params(group)
    assert seconds > 0 and stats.bytes == sum(t.numel() * 4 for t in trainer.values())
    for engine_state in engines.group.run_all("state_dict"):
        for name, tensor in trainer.items():
            assert torch.equal(engine_state[name], tensor), name
    after = engines.generate(PROMPTS, params)
    colocated = policy.generate(PROMPTS, params)
    assert after.token_ids == colocated.token_ids
    for a, b in zip(after.logprobs, colocated.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    # The refit changed what the engines generate (the test would pass without one otherwise).
    assert engines.generate(PROMPTS, greedy).token_ids != before.token_ids or any(
        not torch.allclose(torch.tensor(a), torch.tensor(b))
        for a, b in zip(engines.generate(PROMPTS, greedy).logprobs, before.logprobs, strict=True)
    )


def test_a_refit_with_missing_or_foreign_tensors_is_refused(tiny_path, ray_cluster):
    from nrl_core.weight_sync import WeightSender

    config = make_config(tiny_path)
    engines = engines_for(config, num_engines=1)
    try:
        engine = engines.group.actors[0]
        sender = WeightSender(receivers=[engine], transport="shm")
        with pytest.raises(Exception, match="does not have"):
            sender.send([{"not.a.weight": torch.zeros(2)}])
        with pytest.raises(Exception, match="sent no value for"):
            sender.send([{"lm_head.weight": torch.zeros_like(_lm_head(tiny_path))}])
    finally:
        engines.shutdown()


def _lm_head(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).lm_head.weight.detach()


def test_killing_an_engine_mid_run_is_a_named_error(setup):
    import ray

    _, _, _, engines = setup
    ray.kill(engines.group.actors[1])
    with pytest.raises(Exception, match="generation") as info:
        engines.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert "rank 1 died in generate" in str(info.value)


def test_an_engine_killed_between_steps_is_named_at_the_refit(setup):
    """An asynchronous run refits engines between steps: a kill -9 of an engine then showed
    as ``policy rank 0 failed in push_weights: ActorDiedError`` (the policy rank's call into
    the engine failed), naming neither the engine, nor its pid, nor the signal."""
    import os
    import signal
    import time

    from nrl_core.distributed.errors import WorkerError

    _, policy, _, engines = setup
    pid = engines.group.infos[1].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(WorkerError) as info:
        engines.refit(policy)
    message = str(info.value)
    assert message.startswith(
        f"generation-torch rank 1 died in refit (pid {pid}): its process was killed or exited "
        "without a word (SIGKILL"
    ), message
    assert "push_weights" not in message


@pytest.mark.gpu_sim
def test_the_engine_keeps_the_memory_contract(tiny_path, monkeypatch):
    """Under ``NRL_MEMORY_CONTRACT=1`` a torch engine's sleep is a GPU engine's deep sleep:
    the weights are lost (NaN) and generate refuses until a refit has written every one;
    waking an awake tag is an error. After the refit it generates what it did before."""
    from nrl_dtensor.engine import TorchEngine

    from nrl_core.memory_contract import MemoryContractError
    from nrl_core.weight_sync.shm import send_shm

    monkeypatch.setenv("NRL_MEMORY_CONTRACT", "1")
    config = make_config(tiny_path)
    engine = TorchEngine(TorchGenerationConfig(colocated=False), context(config))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(PROMPTS, greedy)
    state = engine.state_dict()

    assert engine.sleep() is False
    assert all(torch.isnan(p).all() for p in engine.model.parameters())
    with pytest.raises(MemoryContractError, match="weights dropped at sleep"):
        engine.generate(PROMPTS, greedy)
    engine.sleep()
    engine.begin_weight_update()  # wakes the weights only
    with pytest.raises(MemoryContractError, match="is awake"):
        engine.wake_up(["weights"])
    send_shm(state, engine.receive_bucket, lambda received: received)
    engine.finish_weight_update()
    assert engine.generate(PROMPTS, greedy).token_ids == before.token_ids
    with pytest.raises(MemoryContractError, match="are awake"):
        engine.wake_up()  # generate woke the KV cache: nothing sleeps


# -- LoRA refits (issue 52 item 1) ---------------------------------------------------------------


def _lora_engines(config, mode: str):
    config.generation.lora_refit = mode
    return engines_for(config, num_engines=1)


def test_lora_refits_send_only_the_adapters_and_the_engine_follows_the_trainer(
    tiny_path, start_group
):
    """A LoRA policy (rank 4) and two separate engines of the same run, one refitted with
    adapters only and one with the adapters merged into the whole model: after each of two
    training steps and refits, both engines' greedy samples and logprobs equal the trainer's
    (to 1e-5), the adapter refit moves exactly the adapter tensors' bytes, and the merged one
    the whole model's."""
    config = make_config(tiny_path, lr=5e-3)
    options = DTensorConfig(lora_rank=4)
    config.policy.options["dtensor"] = options
    group = start_group(WORKER, (options, context(config)))
    policy = Policy.from_config(group, config.policy)
    adapters = _lora_engines(config, "adapters")
    merged = _lora_engines(config, "merged")
    assert (adapters.lora_refit, merged.lora_refit) == ("adapters", "merged")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        adapter = group.run_all("lora_adapter_tensors")[0]
        adapter_bytes = sum(t.numel() * 4 for t in adapter.values())
        plain = group.run_all("bucket_list", 1 << 30)[0]
        model_bytes = sum(t.numel() * 4 for b in plain for t in b.values())
        assert any(".lora_A." in n for n in adapter) and 0 < adapter_bytes < model_bytes / 10
        assert not any("lora" in n or "base_layer" in n for b in plain for n in b)
        before = adapters.generate(PROMPTS, greedy)
        for step in (1, 2):
            policy.train(make_batch(8, seed=step), TokenMeanNLL())
            for engines, expected in ((adapters, adapter_bytes), (merged, model_bytes)):
                engines.refit(policy)
                assert engines.last_refit.bytes == expected, (step, engines.lora_refit)
                out = engines.generate(PROMPTS, greedy)
                trainer = policy.generate(PROMPTS, greedy)
                assert out.token_ids == trainer.token_ids, (step, engines.lora_refit)
                for a, b in zip(out.logprobs, trainer.logprobs, strict=True):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
        # The adapters moved the engine off the base model (else the test proves nothing).
        after = adapters.generate(PROMPTS, greedy)
        assert after.token_ids != before.token_ids or any(
            not torch.allclose(torch.tensor(a), torch.tensor(b))
            for a, b in zip(after.logprobs, before.logprobs, strict=True)
        )
        print(f"refit/bytes adapters={adapter_bytes} merged={model_bytes}")
    finally:
        adapters.shutdown()
        merged.shutdown()


# -- in-flight refits and per-token weight versions (issue 51 item 2) ---------------------------


def test_a_refit_lands_between_decode_steps_of_a_call_in_flight(tiny_path):
    """A refit sent while a call generates (from another thread, after the call's fourth
    forward) is staged and swapped in before the fifth: every row's first four tokens are
    version 0's (what the old weights generate alone) and carry version 0, the rest carry
    version 1, and afterwards the engine holds the new weights."""
    import threading

    from nrl_dtensor.engine import TorchEngine

    from nrl_core.weight_sync.shm import send_shm

    config = make_config(tiny_path)
    engine = TorchEngine(TorchGenerationConfig(colocated=False, stop_at_eos=False), context(config))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert engine.generate(PROMPTS, greedy).weight_versions is None  # version unknown yet
    engine.set_weight_version(0)
    old = engine.generate(PROMPTS, greedy)
    assert old.weight_versions == [[0] * 10] * len(PROMPTS)
    new_state = {n: t * 1.5 if t.is_floating_point() else t for n, t in engine.state_dict().items()}

    def refit() -> None:
        engine.begin_weight_update()
        send_shm(new_state, engine.receive_bucket, lambda received: received)
        engine.finish_weight_update()

    forwards = []

    def refit_after_fourth_forward(module, args) -> None:
        forwards.append(1)
        if len(forwards) == 4:  # the refit runs to its end before this forward returns
            thread = threading.Thread(target=refit)
            thread.start()
            thread.join(30)

    hook = engine.model.register_forward_pre_hook(refit_after_fourth_forward)
    try:
        mixed = engine.generate(PROMPTS, greedy)
    finally:
        hook.remove()
    assert mixed.weight_versions == [[0] * 4 + [1] * 6] * len(PROMPTS)
    assert [row[:4] for row in mixed.token_ids] == [row[:4] for row in old.token_ids]
    assert mixed.token_ids != old.token_ids  # the new weights generated the rest
    assert engine.weight_version == 1
    held = engine.state_dict()
    assert all(torch.equal(held[n], new_state[n]) for n in new_state)
    after = engine.generate(PROMPTS, greedy)
    assert after.weight_versions == [[1] * 10] * len(PROMPTS)


def _logprobs_of(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Each of ``ids``' logprobs under ``model`` after ``prompt`` (one plain forward)."""
    sequence = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_a_refit_through_the_core_lands_in_a_call_in_flight(tiny_path, start_group):
    """``GenerationEngines(in_flight=True)``: a refit sent while a long generate call runs on a
    torch engine actor lands between two of its decode steps. Every row's tokens carry two
    versions (old then new, switching at one step); the tokens before the switch are the old
    weights' (their logprobs match the old model's forward), those after come from the new
    weights (their logprobs lie nearer the new model's forward than the old one's: the KV cache
    of the earlier tokens keeps the old weights' keys, so neither matches exactly); and the
    engine ends on the trainer's weights, bit for bit, sampling what the trainer samples."""
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.engines import generate_in_flight

    # A large learning rate: one step moves the weights far enough to tell them apart.
    config = make_config(tiny_path, lr=0.05)
    policy = Policy.from_config(
        start_group(WORKER, (DTensorConfig(), context(config))), config.policy
    )
    config.generation.options["torch"] = TorchGenerationConfig(
        colocated=False, num_engines=1, stop_at_eos=False
    )
    spec = ComponentSpec(
        kind="generation", name="torch", target="nrl_dtensor.engine:TorchEngine", plugin="test"
    )
    engines = start_generation_engines(spec, config, on_gpu=False, timeout_s=300, in_flight=True)
    try:
        prompts = [[1, 5, 20 + i, 21, 22] for i in range(8)]
        greedy = SamplingParams(max_new_tokens=150, temperature=0.0)
        engines.refit(policy, version=0)
        policy.train(make_batch(8, seed=1), TokenMeanNLL())
        with generate_in_flight(engines, prompts, greedy, busy="_generating") as call:
            engines.refit(policy, version=1)
        mixed = call.output

        old_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
        new_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
        held = engines.group.run_all("state_dict")[0]
        new_model.load_state_dict(held)
        trainer = full_params(policy.group)
        assert all(torch.equal(held[n], t) for n, t in trainer.items())  # ends on new weights

        switch = mixed.weight_versions[0].index(1)  # the first decode step on the new weights
        assert 0 < switch < greedy.max_new_tokens, mixed.weight_versions[0]
        nearer_new = 0
        for prompt, ids, lps, versions in zip(
            prompts, mixed.token_ids, mixed.logprobs, mixed.weight_versions, strict=True
        ):
            assert versions == [0] * switch + [1] * (len(ids) - switch)
            engine_lps = torch.tensor(lps)
            old_lps, new_lps = (_logprobs_of(m, prompt, ids) for m in (old_model, new_model))
            torch.testing.assert_close(engine_lps[:switch], old_lps[:switch], rtol=0, atol=1e-4)
            after = slice(switch, None)
            to_new = (engine_lps[after] - new_lps[after]).abs().mean()
            to_old = (engine_lps[after] - old_lps[after]).abs().mean()
            nearer_new += int(to_new < to_old)
        assert nearer_new == len(prompts), f"{nearer_new} of {len(prompts)} rows"

        after_refit = engines.generate(prompts, greedy)
        assert after_refit.weight_versions == [[1] * greedy.max_new_tokens] * len(prompts)
        assert after_refit.token_ids == policy.generate(prompts, greedy).token_ids
        print(f"in-flight refit landed at decode step {switch} of {greedy.max_new_tokens}")
    finally:
        engines.shutdown()
