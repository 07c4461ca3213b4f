"""Vocabulary-parallel logprobs (nrl_dtensor.vocab_parallel, review m10) on 2 gloo ranks: an
``lm_head`` sharded by ``ColwiseParallel(output_layouts=Shard(-1))`` gives each rank its slice
of the logits; the logprobs and the gradients equal the unsharded ``log_softmax`` path's."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from nrl_core.testing.ranks import gloo_world

# Spawned gloo ranks (a multi-process run): the slow tier (docs/testing.md).
pytestmark = pytest.mark.slow

B, T, H, V, K, TEMPERATURE = 2, 6, 8, 11, 3, 0.7  # V = 11: uneven slices (6 + 5)


def _inputs():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    at = torch.randint(0, V, (B, T, K), generator=g)
    return weight, hidden, ids, at


def _reference():
    """The unsharded path in float64: the exact values the ranks' float32 must come within
    rounding of. A float32 reference rounds apart from the ranks' sharded matmuls as the CPU's
    kernels go: on an AVX-512 machine their gradients were 1.9e-6 apart (the test failed),
    the ranks' within 1.7e-6 of these."""
    weight, hidden, ids, at = (t.double() if t.is_floating_point() else t for t in _inputs())
    hidden.requires_grad_()
    log_probs = torch.log_softmax(hidden @ weight.T / TEMPERATURE, dim=-1)
    tokens = torch.nn.functional.pad(log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    at_lp = log_probs.gather(-1, at)
    (tokens.sum() + 0.5 * at_lp.sum()).backward()
    return tokens.detach(), at_lp.detach(), hidden.grad


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from nrl_dtensor.vocab_parallel import (
        logprobs_of,
        token_logprobs,
        vocab_parallel_topk,
        vocab_slice,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with gloo_world(rank, world, store):
        mesh = init_device_mesh("cpu", (world,))
        weight, hidden, ids, at = _inputs()
        head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        # The TP plan's entry for the model's lm_head (see the module docstring).
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1)))
        hidden.requires_grad_()
        local = head(hidden) / TEMPERATURE
        start, stop = vocab_slice(V, rank, world)
        group = mesh.get_group()
        tokens = token_logprobs(local, ids, start, group)
        at_lp = logprobs_of(local, at, start, group)
        (tokens.sum() + 0.5 * at_lp.sum()).backward()
        with torch.no_grad():
            # k = 4 is within each slice; V + 5 exceeds the vocabulary and either slice.
            topk = [vocab_parallel_topk(local, ids, k, start, group) for k in (4, V + 5)]
        torch.save(
            {
                "width": local.shape[-1],
                "slice": (start, stop),
                "tokens": tokens.detach(),
                "at": at_lp.detach(),
                "grad": hidden.grad,
                "topk": topk,
            },
            f"{out}/rank{rank}.pt",
        )


def test_vocab_sharded_logprobs_and_gradients_equal_the_full_log_softmax(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tokens, at_lp, grad = _reference()
    # Each rank held only its slice of the vocabulary (the memory TP should save).
    assert [r["slice"] for r in ranks] == [(0, 6), (6, 11)]
    assert [r["width"] for r in ranks] == [6, 5]
    for r in ranks:
        # Within float32 rounding of the exact values (up to 1.7e-6 here, on values up to 20).
        torch.testing.assert_close(r["tokens"].double(), tokens, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["at"].double(), at_lp, rtol=1e-6, atol=1e-6)
        # The input gradient once, not once per rank.
        torch.testing.assert_close(r["grad"].double(), grad, rtol=1e-6, atol=1e-6)


def test_vocab_sharded_topk_equals_the_full_distributions_top_k(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    weight, hidden, ids, _ = _inputs()
    log_probs = torch.log_softmax(hidden @ weight.T / TEMPERATURE, dim=-1)
    for r in ranks:
        for (tokens, values, top_ids), k in zip(r["topk"], (4, V + 5), strict=True):
            want_values, want_ids = log_probs.topk(min(k, V), dim=-1)
            assert values.shape == top_ids.shape == (B, T, min(k, V))
            # Values near -16 differ by float32 rounding (~1e-7 relative) from the other sum.
            torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-6)
            assert torch.equal(top_ids, want_ids)
            torch.testing.assert_close(tokens, log_probs.gather(-1, ids[..., None])[..., 0])
