"""LoRA on the megatron policy (issue 52 item 2): adapters on Megatron's tensor-parallel
layers that are peft's adapters of the Hugging Face model.

Tolerances, float32 on CPU, as in test_megatron.py: logprobs 1e-5 absolute, losses and
gradient norms 1e-5 relative; adapter tensors across layouts 1e-5 absolute (the same sums in
another order, through two Adam steps, whose ``m / sqrt(v)`` magnifies the rounding of small
gradients: observed 1.2e-6 at most).
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import requires_megatron
from test_megatron import WORKER, context, make_config

from nrl_core.policy import Policy
from nrl_core.testing.batches import TokenMeanNLL, make_batch

pytestmark = requires_megatron

HELPERS = "_lora_helpers"


def lora_options(tp=1, rank=8, dropout=0.0, targets=None):
    from nrl_megatron.config import MegatronConfig

    extra = {} if targets is None else {"lora_target_modules": targets}
    return MegatronConfig(
        tensor_model_parallel_size=tp,
        lora_rank=rank,
        lora_alpha=16.0,
        lora_dropout=dropout,
        **extra,
    )


def start(start_group, pool, options, config, name="policy"):
    group = start_group(pool, WORKER, (options, context(config)), name=name)
    return group, Policy.from_config(group, config.policy)


def run(group, fn: str, *args):
    import _lora_helpers

    return group.run_all(getattr(_lora_helpers, fn), *args)


def test_step_zero_is_the_base_model_and_only_adapters_train(tiny_path, pool1, start_group):
    from transformers import AutoConfig

    config = make_config(tiny_path)
    batch = make_batch(8, seed=1)
    _, base = start(start_group, pool1, lora_options(rank=0), config, name="base")
    want = base.get_logprobs(batch)

    group, lora = start(start_group, pool1, lora_options(), config)
    # B starts at zero: the adapter adds +0.0 everywhere, so the logprobs are the base's bits.
    torch.testing.assert_close(lora.get_logprobs(batch), want, rtol=0, atol=0)
    names = run(group, "trainable")[0]
    assert names["requires_grad"] == names["optimizer"]
    assert names["requires_grad"] and all(".lora_" in n for n in names["requires_grad"])
    # Every layer's (q, k, v, o, gate, up, down) x (A, B).
    layers = AutoConfig.from_pretrained(tiny_path).num_hidden_layers
    assert len(names["optimizer"]) == layers * 7 * 2

    before = run(group, "split_state")[0]
    for _ in range(2):
        metrics = lora.train(batch, TokenMeanNLL())
        assert metrics["grad_norm"] > 0
    after = run(group, "split_state")[0]
    assert after["base"].keys() == before["base"].keys()
    for name, tensor in before["base"].items():
        assert torch.equal(after["base"][name], tensor), name  # the base is frozen
    changed = [n for n, t in before["lora"].items() if not torch.equal(after["lora"][n], t)]
    assert sorted(changed) == sorted(before["lora"])  # every A and B moved in two steps
    assert (lora.get_logprobs(batch) - want).abs().max() > 1e-4
    # The reference (KL) stays the base model.
    torch.testing.assert_close(lora.get_logprobs(batch, reference=True), want, rtol=0, atol=0)


def test_tensor_parallel_matches_one_rank(tiny_path, pool1, pool2, start_group):
    """TP=2 (both ranks the whole batch) vs one rank: logprobs, two steps' losses and gradient
    norms, and the adapters after them, with dropout on (the masks do not depend on the
    layout, nrl_megatron.lora)."""
    config = make_config(tiny_path)
    batch = make_batch(8, seed=2)
    single_group, single = start(start_group, pool1, lora_options(dropout=0.1), config, "one")
    want_lp = single.get_logprobs(batch)
    want = [single.train(batch, TokenMeanNLL()) for _ in range(2)]
    want_lp_after = single.get_logprobs(batch)
    want_adapters = run(single_group, "full_adapters")[0]

    group, tp2 = start(start_group, pool2, lora_options(tp=2, dropout=0.1), config)
    torch.testing.assert_close(tp2.get_logprobs(batch), want_lp, rtol=0, atol=1e-5)
    for step in range(2):
        got = tp2.train(batch, TokenMeanNLL())
        for key in ("loss", "tokens", "grad_norm"):
            assert got[key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    torch.testing.assert_close(tp2.get_logprobs(batch), want_lp_after, rtol=0, atol=1e-5)
    assert (want_lp_after - want_lp).abs().max() > 1e-4  # the steps changed the model
    adapters = run(group, "full_adapters")
    for rank_adapters in adapters:  # every rank gathers the same full tensors
        assert rank_adapters.keys() == want_adapters.keys()
        for name, tensor in want_adapters.items():
            torch.testing.assert_close(rank_adapters[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("tp", "model"), [(1, "tiny_path"), (2, "tiny_path"), (1, "tiny_qwen2_path")]
)
def test_adapters_are_peft_adapters_and_export_merges_them(
    tp, model, request, tmp_path, pool1, pool2, start_group
):
    """After two steps (TP=1: one rank holds both query groups, whose q/k/v outputs the
    adapter interleaves as linear_qkv does; TP=2: the tensors are gathered over the ranks;
    Qwen2: q/k/v biases and tied embeddings): ``lora_adapter_tensors`` loaded into peft on the HF base model,
    and the merged ``export_hf`` folder, give the policy's logprobs; the ``base`` stream is
    the checkpoint's weights, bit for bit; the merged stream is the exported folder's."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tiny_path = request.getfixturevalue(model)
    config = make_config(tiny_path)
    batch = make_batch(6, seed=3)
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # k and gate left out
    pool = pool1 if tp == 1 else pool2
    group, lora = start(start_group, pool, lora_options(tp=tp, targets=targets), config)
    for _ in range(2):
        lora.train(batch, TokenMeanNLL())
    want = lora.get_logprobs(batch)

    def logprobs(model) -> torch.Tensor:
        ids = batch["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        got = torch.nn.functional.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        return got * (torch.arange(ids.shape[1])[None, :] < batch["lengths"][:, None])

    adapters = run(group, "full_adapters")[0]
    adapter = group.run_all("lora_adapter", 3)[0]
    assert adapter.target_modules == tuple(sorted(targets)) and adapter.version == 3
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    peft_model = get_peft_model(
        base,
        LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(targets)),
    ).eval()
    result = set_peft_model_state_dict(peft_model, adapters)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if ".lora_" in k]
    assert not any(
        k.endswith(("k_proj.lora_A.weight", "gate_proj.lora_A.weight")) for k in adapters
    )
    torch.testing.assert_close(logprobs(peft_model), want, rtol=0, atol=1e-5)

    group.run_all("export_hf", str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    torch.testing.assert_close(logprobs(exported), want, rtol=0, atol=1e-5)
    # Negative control: the base model alone is measurably off the trained policy.
    plain = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    assert (logprobs(plain) - want).abs().max() > 1e-4

    checkpoint = load_file(str(tiny_path / "model.safetensors"))
    for streamed in run(group, "base_buckets"):
        assert streamed.keys() == checkpoint.keys()
        for name, tensor in checkpoint.items():
            assert torch.equal(streamed[name], tensor), name
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    merged = run(group, "merged_buckets")[0]
    for name, tensor in written.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_resume_continues_the_adapters_exactly(tp, tiny_path, tmp_path, pool1, pool2, start_group):
    """4 steps straight vs 2 steps, a checkpoint, a fresh policy that loads it, 2 more:
    identical losses and adapter tensors (Adam's moments, the step count and the dropout
    generator are restored; the base weights are the checkpoint's)."""
    pool = pool1 if tp == 1 else pool2
    config = make_config(tiny_path)
    batches = [make_batch(8, seed=10 + i) for i in range(4)]
    group, straight = start(start_group, pool, lora_options(tp=tp, dropout=0.1), config, "a")
    want = [straight.train(b, TokenMeanNLL()) for b in batches]
    want_adapters = run(group, "full_adapters")[0]

    group, first = start(start_group, pool, lora_options(tp=tp, dropout=0.1), config, "b")
    got = [first.train(b, TokenMeanNLL()) for b in batches[:2]]
    first.save_checkpoint(str(tmp_path / "ckpt"))
    group, resumed = start(start_group, pool, lora_options(tp=tp, dropout=0.1), config, "c")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got += [resumed.train(b, TokenMeanNLL()) for b in batches[2:]]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["loss"] == w["loss"] and g["grad_norm"] == w["grad_norm"], step
    adapters = run(group, "full_adapters")[0]
    for name, tensor in want_adapters.items():
        assert torch.equal(adapters[name], tensor), name


@pytest.mark.slow
def test_two_pipeline_stages_match_one(tiny_path, pool1, pool2, start_group):
    """PP=2 vs one stage: the adapters start the same (their init follows whole-model layer
    numbers), a step trains them the same, and every rank gathers every stage's adapters."""
    from nrl_megatron.config import MegatronConfig

    config = make_config(tiny_path, mbs=2)
    batch = make_batch(8, seed=5)
    runs = {}
    for pp, pool in ((1, pool1), (2, pool2)):
        options = MegatronConfig(pipeline_model_parallel_size=pp, lora_rank=8)
        group, lora = start(start_group, pool, options, config, name=f"pp{pp}")
        metrics = [lora.train(batch, TokenMeanNLL()) for _ in range(2)]
        runs[pp] = metrics, lora.get_logprobs(batch), run(group, "full_adapters")
    (want, want_lp, (want_adapters,)), (got, got_lp, got_adapters) = runs[1], runs[2]
    for step in range(2):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    for adapters in got_adapters:
        assert adapters.keys() == want_adapters.keys()
        for name, tensor in want_adapters.items():
            torch.testing.assert_close(
                adapters[name], tensor, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.slow
def test_resume_across_a_change_of_tensor_parallelism(
    tiny_path, tmp_path, pool1, pool2, start_group
):
    """A TP=2 checkpoint resumed on one rank (the adapters and their AdamW moments resharded:
    column layers' B and row layers' A are the split ones) takes the uninterrupted run's
    second step. Adapters within 1e-4 (as test_pipeline.py's resume across stages): the TP=2
    step's rounding, through Adam's ``m / sqrt(v)`` of small gradients, reaches 1.6e-5 after
    the second step (one element of 1024); a step moves them by ~1e-3 (lr)."""
    config = make_config(tiny_path)
    first, second = make_batch(8, seed=4), make_batch(8, seed=5)
    group, straight = start(start_group, pool1, lora_options(), config, "straight")
    straight.train(first, TokenMeanNLL())
    want = straight.train(second, TokenMeanNLL())
    want_adapters = run(group, "full_adapters")[0]

    saving_group, saving = start(start_group, pool2, lora_options(tp=2), config, "saving")
    saving.train(first, TokenMeanNLL())
    saving.save_checkpoint(str(tmp_path / "ckpt"))
    saved = run(saving_group, "full_adapters")[0]
    group, resumed = start(start_group, pool1, lora_options(), config, "resumed")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.train(second, TokenMeanNLL())
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    adapters = run(group, "full_adapters")[0]
    for name, tensor in want_adapters.items():
        torch.testing.assert_close(
            adapters[name], tensor, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The second step moved the adapters by much more than that tolerance.
    assert max((want_adapters[n] - saved[n]).abs().max() for n in saved) > 5e-4
