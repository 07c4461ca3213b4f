"""``nrl_megatron.grouped_experts.GroupedMatmulExperts``: Megatron-Core's ``SequentialMLP``
with one ``torch.nn.functional.grouped_mm`` per projection (GPU review 3, M3).

Against ``SequentialMLP`` with the same weights and routed tokens, float32 on CPU: output and
every gradient equal within 1e-6 (observed: bit-identical; ``grouped_mm`` on CPU runs the same
matmul per group), an expert with no tokens included. The forward reads no token count on the
host. The GPU config (``on_gpu=True``) builds its MoE layers on it, under the names the
converter, refit and checkpoints use.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_helpers import requires_megatron

pytestmark = requires_megatron

HELPERS = "_grouped_experts_helpers"
PROBE = "_megatron_helpers:ParallelStateProbe"


def _helper(name: str):
    import importlib

    return getattr(importlib.import_module(HELPERS), name)


@pytest.fixture
def probe(pool1, start_group):
    return start_group(pool1, PROBE, (), name="grouped-experts")


@pytest.mark.parametrize(
    "counts",
    [[7, 0, 12, 3], [0, 0, 9, 0], [5], [0, 0, 0, 0]],
    ids=["an-expert-without-tokens", "one-busy-expert", "one-local-expert", "no-tokens"],
)
def test_grouped_experts_equal_sequential_mlp_output_and_gradients(probe, counts):
    run = _helper("forward_backward")
    want = probe.run_all(run, "sequential", counts, "float32")[0]
    got = probe.run_all(run, "grouped", counts, "float32")[0]
    assert (want["type"], got["type"]) == ("SequentialMLP", "GroupedMatmulExperts")
    assert got["bias"] is None and want["bias"] is None
    assert got["out"].shape == (sum(counts), 64)
    close = {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(got["out"], want["out"], **close)
    assert sorted(got["grads"]) == sorted(want["grads"])  # the same parameter names
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, **close, msg=name)
    torch.testing.assert_close(got["grad_x"], want["grad_x"], **close)
    torch.testing.assert_close(got["grad_probs"], want["grad_probs"], **close)
    if counts[0] == 0 and len(counts) > 1:
        # An expert that saw no token gets a zero gradient, not garbage.
        assert got["grads"]["local_experts.0.linear_fc1.weight"].abs().max() == 0
    if sum(counts):
        assert max(float(g.abs().max()) for g in want["grads"].values()) > 0
    # No stacked [experts, out, in] copy of the weights is kept until the backward (autograd
    # through torch.stack + grouped_mm would keep one per projection per layer).
    assert [shape for shape in got["saved"] if len(shape) == 3] == []


def test_grouped_experts_equal_sequential_mlp_in_bfloat16(probe):
    """bfloat16 (the GPU path's dtype), on CPU: within bf16 rounding of SequentialMLP."""
    run = _helper("forward_backward")
    counts = [6, 0, 11, 4]
    want = probe.run_all(run, "sequential", counts, "bfloat16")[0]
    got = probe.run_all(run, "grouped", counts, "bfloat16")[0]
    assert got["out"].dtype == torch.bfloat16
    torch.testing.assert_close(got["out"], want["out"], rtol=1.6e-2, atol=1e-3)
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1.6e-2, atol=1e-3, msg=name)


def test_grouped_forward_reads_no_token_count_on_the_host(probe):
    """``SequentialMLP`` calls ``tokens_per_expert.tolist()`` (a device-to-host sync per
    layer on a device tensor); the grouped forward reads nothing on the host."""
    read = _helper("host_read_in_forward")
    assert probe.run_all(read, "sequential")[0] == "host read: Tensor.tolist"
    assert probe.run_all(read, "grouped")[0] is None


def test_grouped_experts_with_biases_equal_the_per_expert_forward(probe):
    """gpt-oss's experts: linear biases (``add_bias_linear``, fc2's scaled by the routing
    probability as ``MLP.forward`` scales it) and its clamped gate (``glu_linear_offset``,
    ``activation_func_clamp_value``): output and every gradient, the biases' included, equal
    ``MLP.forward``'s per-expert computation written out in plain torch (the helpers'
    ``_PlainTorchExperts``: ``SequentialMLP`` cannot backpropagate biases on one rank); the
    forward still reads no count on the host."""
    import functools

    from nrl_megatron.model import gpt_oss_quick_glu

    gpt_oss = {
        "add_bias_linear": True,
        "glu_linear_offset": 1.0,
        # Small enough that some of the 0.2-scale pre-activations are clamped.
        "activation_func_clamp_value": 0.3,
        "activation_func": functools.partial(gpt_oss_quick_glu, alpha=1.702),
    }
    run = _helper("forward_backward")
    counts = [7, 0, 12, 3]
    want = probe.run_all(run, "reference", counts, "float32", gpt_oss)[0]
    got = probe.run_all(run, "grouped", counts, "float32", gpt_oss)[0]
    assert "local_experts.2.linear_fc2.bias" in want["grads"]
    assert sorted(got["grads"]) == sorted(want["grads"])
    close = {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(got["out"], want["out"], **close)
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, **close, msg=name)
    torch.testing.assert_close(got["grad_x"], want["grad_x"], **close)
    torch.testing.assert_close(got["grad_probs"], want["grad_probs"], **close)
    assert got["grads"]["local_experts.1.linear_fc1.bias"].abs().max() == 0  # no tokens
    assert want["grads"]["local_experts.2.linear_fc2.bias"].abs().max() > 0
    read = _helper("host_read_in_forward")
    assert probe.run_all(read, "grouped", gpt_oss)[0] is None


@pytest.mark.gpu_sim
def test_gpu_config_builds_moe_layers_on_grouped_experts(probe):
    """``transformer_config(..., on_gpu=True)`` + the local spec for a Qwen3-MoE shape: every
    MoE layer's experts are ``GroupedMatmulExperts`` (``SequentialMLP`` before), with
    ``SequentialMLP``'s parameter names, and a bfloat16 forward and backward runs."""
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    out = probe.run_all(_helper("gpu_config_moe_model"), shape)[0]
    assert (out["use_cpu_initialization"], out["dispatcher"]) == (False, "alltoall")  # GPU's
    assert out["spec_experts"] == "GroupedMatmulExperts"
    assert out["expert_types"] == ["GroupedMatmulExperts"]
    assert out["expert_params"] == sorted(
        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
        for layer in range(2)
        for e in range(4)
        for fc in (1, 2)
    )
    assert out["finite"]
    assert len(out["expert_grads"]) == 2 * 4 * 2
    assert sum(g > 0 for g in out["expert_grads"]) > 0
