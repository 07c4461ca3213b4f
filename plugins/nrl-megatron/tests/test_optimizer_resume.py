"""Resuming Megatron's distributed optimizer on torch's Adam (no Apex, no Transformer Engine),
pinned on CPU (``gpu_sim``): the real optimizer needs CUDA, so these tests reproduce the two
steps of Megatron-Core 0.16.1 that broke the ``gpu`` resume test on an H100 (2026-11-26) with
torch's own ``Adam`` and check :func:`nrl_megatron.checkpoint._adam_step_set_aside` against them:

- ``DistributedOptimizer.load_state_dict`` gives every parameter's state the SAME ``step``
  tensor (distrib_optimizer.py:817-825);
- ``_set_main_param_and_optimizer_states`` copies every key of the live state from the loaded
  parameter state, which holds ``param``, ``exp_avg`` and ``exp_avg_sq`` only (:939).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu_sim


def _adam_after_one_step(seed: int = 0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _load_like_megatron(opt, saved: dict) -> None:
    """Megatron's load path on torch Adam: one shared ``step`` per state, then the parameter
    state copied key by key from a file that has no ``step``."""
    step = torch.tensor(1.0)
    for p in opt.param_groups[0]["params"]:
        opt.state[p] = {"exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
        opt.state[p]["step"] = step  # the same tensor object for every parameter
    for p in opt.param_groups[0]["params"]:
        dst = {"param": p.data, **opt.state[p]}
        for key in dst:  # KeyError on "step" unless it is set aside
            dst[key].copy_(saved[id(p)][key])


def _saved_parameter_state(params, opt) -> dict:
    return {
        i: {"param": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}}
        for i, p in enumerate(params)
    }


def _fresh_like(params):
    clones = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    return clones, torch.optim.Adam(clones, lr=0.1)


def test_loading_without_the_step_set_aside_fails_as_on_the_gpu():
    params, opt = _adam_after_one_step()
    saved = _saved_parameter_state(params, opt)
    for state in saved.values():
        state.pop("step")  # the parameter state file's keys
    clones, resumed = _fresh_like(params)
    saved = {id(c): saved[i] for i, c in enumerate(clones)}
    with pytest.raises(KeyError, match="step"):
        _load_like_megatron(resumed, saved)


def test_the_step_set_aside_loads_and_the_next_step_equals_the_uninterrupted_one():
    from nrl_megatron.checkpoint import _adam_step_set_aside

    params, opt = _adam_after_one_step()
    saved = _saved_parameter_state(params, opt)
    for state in saved.values():
        state.pop("step")
    clones, resumed = _fresh_like(params)
    saved = {id(c): saved[i] for i, c in enumerate(clones)}
    # Megatron's load_state_dict runs first and sets the shared step; the parameter state is
    # loaded inside the context.
    step = torch.tensor(1.0)
    for p in clones:
        resumed.state[p] = {
            "exp_avg": torch.empty_like(p),
            "exp_avg_sq": torch.empty_like(p),
            "step": step,
        }
    with _adam_step_set_aside([resumed]):  # the torch Adam a DistributedOptimizer wraps
        assert all("step" not in resumed.state[p] for p in clones)
        for p in clones:
            dst = {"param": p.data, **resumed.state[p]}
            for key in dst:
                dst[key].copy_(saved[id(p)][key])
    steps = [resumed.state[p]["step"] for p in clones]
    assert steps[0] is not steps[1], "each parameter needs its own step tensor"
    assert [float(s) for s in steps] == [1.0, 1.0]

    grads = [torch.randn_like(p) for p in params]
    for p, c, g in zip(params, clones, grads, strict=True):
        p.grad, c.grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    for p, c in zip(params, clones, strict=True):
        torch.testing.assert_close(c.detach(), p.detach(), rtol=0, atol=0)


def test_a_shared_step_skews_the_step_after_a_resume():
    """Why each parameter gets its own copy back: with the shared tensor, torch's Adam counts
    every parameter's update, and the bias correction of the next step is wrong."""
    params, opt = _adam_after_one_step()
    saved = _saved_parameter_state(params, opt)
    clones, resumed = _fresh_like(params)
    step = torch.tensor(1.0)
    for i, c in enumerate(clones):
        c.data.copy_(saved[i]["param"])
        resumed.state[c] = {"exp_avg": saved[i]["exp_avg"], "exp_avg_sq": saved[i]["exp_avg_sq"]}
        resumed.state[c]["step"] = step  # shared, as Megatron leaves it
    grads = [torch.randn_like(p) for p in params]
    for p, c, g in zip(params, clones, grads, strict=True):
        p.grad, c.grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    assert float(step) > 2.0  # counted once per parameter
    assert not all(torch.equal(c, p) for p, c in zip(params, clones, strict=True))
