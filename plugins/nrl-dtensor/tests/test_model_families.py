"""The newer model families (issue 48: Qwen3.5 dense and MoE, gpt-oss, Llama 4) in the dtensor
policy on CPU, each a tiny model built locally and loaded through ``from_pretrained``: logprobs
equal to transformers' own forward, a training step, the refit stream in the layout each engine
loads, and a refit into separate torch engines bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_dtensor import local_policy, local_worker, make_config

from nrl_core.testing.batches import TokenMeanNLL, make_batch
from nrl_core.training import valid_token_mask

# Every test here loads a family's model at least once (Qwen3.5's Gated DeltaNet runs
# transformers' reference torch kernels on CPU): about 10 s each on 2 shared cores.
pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_5", "qwen3_5_moe", "gpt_oss", "llama4"]
MODEL_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "gpt_oss": "gpt_oss",
    "llama4": "llama4_text",
}
# Longer than gpt-oss's sliding window (8) and Llama 4's attention chunk (16), so that both
# restrictions shape the logprobs under test.
MAX_LEN = 40


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_path(family, tmp_path_factory):
    from nrl_core.testing.tiny import tiny_model_path

    return tiny_model_path(
        tmp_path_factory.mktemp(f"nrl-{family}"),
        arch=family,
        hidden_size=64,
        num_layers=4,  # Qwen3.5: 3 Gated DeltaNet layers, then a full attention one
    )


def transformers_logprobs(path, batch, temperature=1.0) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[:, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_the_tiny_model_is_the_published_architecture(family, family_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(family_path)
    assert config.model_type == MODEL_TYPES[family]
    types = set(getattr(config, "layer_types", None) or [])
    if family.startswith("qwen3_5"):
        assert types == {"linear_attention", "full_attention"}
    if family == "gpt_oss":
        assert types == {"sliding_attention", "full_attention"}
    if family == "llama4":
        assert types == {"chunked_attention", "full_attention"}
        assert config.moe_layers == [0, 1, 2, 3]


def test_logprobs_are_transformers_and_a_step_trains(family_path):
    """The policy's logprobs are transformers' forward of the checkpoint (1e-5); one step
    changes them, and an export reloads to the trained logprobs."""
    batch = make_batch(6, seed=1, max_len=MAX_LEN)
    valid = valid_token_mask(batch, batch["input_ids"].shape[1])[:, 1:]
    policy = local_policy(make_config(family_path, temperature=0.7, lr=1e-2))
    ours = policy.get_logprobs(batch)[:, 1:]
    theirs = transformers_logprobs(family_path, batch, temperature=0.7)
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=0, atol=1e-5)

    metrics = policy.train(batch, TokenMeanNLL())
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    trained = policy.get_logprobs(batch)[:, 1:]
    # A step of lr 1e-2 on the batch's own tokens makes them likelier.
    assert trained[valid].mean() > ours[valid].mean()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one-process export
def test_an_export_reloads_to_the_trained_logprobs(family_path, tmp_path):
    batch = make_batch(6, seed=2, max_len=MAX_LEN)
    valid = valid_token_mask(batch, batch["input_ids"].shape[1])[:, 1:]
    policy = local_policy(make_config(family_path, lr=1e-2))
    policy.train(batch, TokenMeanNLL())
    policy.export_hf(str(tmp_path / "hf"))
    ours = policy.get_logprobs(batch)[:, 1:]
    theirs = transformers_logprobs(tmp_path / "hf", batch)
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=0, atol=1e-5)


@pytest.mark.gpu_sim
@pytest.mark.parametrize("engine", ["vllm-or-sglang", "torch"])
def test_refit_stream_is_in_the_layout_the_engine_loads(family_path, engine):
    """vLLM and SGLang load the checkpoint's names (their options inherit ``EngineOptions``'
    layout): the refit stream is the saved ``model.safetensors``, name for name and value for
    value. The torch engine (``in_memory``) gets transformers' own state dict."""
    from nrl_dtensor.config import TorchGenerationConfig
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from nrl_core.config.schema import EngineOptions

    layout = (
        EngineOptions.weight_layout if engine != "torch" else TorchGenerationConfig.weight_layout
    )
    worker = local_worker(make_config(family_path))
    sent = [
        item for bucket in worker.state_dict_buckets(1 << 14, layout) for item in bucket.items()
    ]
    names = [name for name, _ in sent]
    assert len(names) == len(set(names))
    if engine == "torch":
        want = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.float32).state_dict()
    else:
        with safe_open(str(family_path / "model.safetensors"), "pt") as f:
            want = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert sorted(names) == sorted(want)
    for name, tensor in sent:
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name


def test_a_separate_torch_engine_follows_a_refit_bit_for_bit(family_path, ray_cluster):
    """After a training step and a refit, a separate torch engine holds the trainer's weights
    bit for bit and samples what the trainer samples."""
    from test_engine import engines_for

    from nrl_core.interfaces import SamplingParams

    config = make_config(family_path, lr=1e-2)
    policy = local_policy(config)
    engines = engines_for(config, num_engines=1)
    try:
        policy.train(make_batch(6, seed=1, max_len=MAX_LEN), TokenMeanNLL())
        engines.refit(policy)
        trainer = {
            name: tensor.detach() for name, tensor in policy.group.worker.model.state_dict().items()
        }
        (engine_state,) = engines.group.run_all("state_dict")
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


REFUSALS = {
    "qwen3_5": "Gated DeltaNet",
    "qwen3_5_moe": "Gated DeltaNet",
    "gpt_oss": "attention-sink",
    "llama4": "chunked attention",
}


def test_layers_the_packed_path_cannot_keep_apart_train_on_padded_rows(family, family_path):
    """Each family has a layer that would mix the samples of a packed row on CPU: the worker
    declares no packing (``sequence_packing=auto`` then pads), and names the layer."""
    from nrl_dtensor.packing import packing_refusal

    worker = local_worker(make_config(family_path))
    assert not worker.supports_sequence_packing
    assert REFUSALS[family] in packing_refusal(worker.model, "cpu", torch.float32)
    assert local_policy(make_config(family_path)).packing is False


def test_plain_attention_still_packs(tiny_path):
    assert local_worker(make_config(tiny_path)).supports_sequence_packing
