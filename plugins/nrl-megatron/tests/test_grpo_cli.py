"""``nrl run grpo policy.backend=megatron`` and ``nrl convert`` through the real CLI, on CPU.

The run is what the ``plugin-megatron`` nox session can hold: this venv's own CLI with
``NRL_ACTOR_ENV=system`` (driver and policy actors in one venv), 2 policy ranks (data parallel
over gloo, inside Ray actors), colocated generation on the Megatron model (``generation.backend``
``torch`` routes to ``MegatronPolicyWorker.generate``; the nox session installs nrl-dtensor,
which registers that backend). nrl-math-env is not installed there, so a fixture plugin (a
dist-info folder on PYTHONPATH) registers a tiny prompt set and an environment whose reward
varies between samples, so that GRPO advantages, and hence updates, are non-zero.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _megatron_helpers import requires_megatron
from safetensors.torch import load_file
from test_megatron import WORKER, context, make_config, megatron_options

from nrl_core.policy import Policy
from nrl_core.testing.batches import make_batch

pytestmark = [
    requires_megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("nrl_dtensor") is None,
        reason="nrl-dtensor (the `torch` generation backend) not installed; nox installs it",
    ),
]

FIXTURE_PLUGIN = '''
from nrl_core import hookimpl
from nrl_core.data import Sample
from nrl_core.interfaces import EnvStep


class TinyPrompts:
    """a+b= prompts (answers unused by the reward below)."""

    def __init__(self, options=None, context=None):
        pass

    def load(self, split):
        n = 64 if split == "train" else 8
        return [
            Sample(messages=[{"role": "user", "content": f"{i % 5}+{i % 3}="}],
                   answer=str(i % 5 + i % 3), task="add")
            for i in range(n)
        ]


class EvenCharacters:
    """Reward: the share of characters with an even code point (varies between samples)."""

    def __init__(self, options=None, context=None):
        pass

    def step(self, conversations, metadata):
        steps = []
        for conversation in conversations:
            text = conversation[-1]["content"]
            reward = sum(ord(c) % 2 == 0 for c in text) / max(1, len(text))
            steps.append(EnvStep(reward=reward, terminated=True))
        return steps


@hookimpl
def nrl_register_datasets(register):
    register("tiny_prompts", "nrl_megatron_fixture:TinyPrompts", description="test prompts")


@hookimpl
def nrl_register_environments(register):
    register("even_characters", "nrl_megatron_fixture:EvenCharacters", description="test reward")
'''

CONFIG = """
grpo:
  max_num_steps: 3
  val_period: 0
  sft_warmup_steps: 0
  num_prompts_per_step: 4
  num_generations_per_prompt: 4
policy:
  backend: megatron
  num_workers: 2
  train_global_batch_size: 16
  train_micro_batch_size: 4
data:
  dataset: tiny_prompts
env:
  name: even_characters
cluster:
  num_cpus: 2
"""


def nrl(root: Path, *args: str) -> subprocess.CompletedProcess:
    """This venv's CLI with the fixture plugin installed and every actor in this venv."""
    env = {
        **os.environ,
        "NRL_ACTOR_ENV": "system",
        "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "nrl_core.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def hf_logprobs(model, batch) -> torch.Tensor:
    """A Hugging Face model's logprobs of ``batch``'s tokens, laid out as the policy's
    ``get_logprobs`` gives them (0 at position 0 and past each row's length)."""
    ids = batch["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    got = torch.nn.functional.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    return got * (torch.arange(ids.shape[1])[None, :] < batch["lengths"][:, None])


def install_fixture_plugin(root: Path) -> None:
    """The fixture plugin (prompts and reward) as a dist-info folder under ``root / "site"``,
    which :func:`nrl` puts on PYTHONPATH."""
    dist_info = root / "site" / "nrl_megatron_fixture-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nrl-megatron-fixture\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[nrl.plugins]\nmegatron_fixture = nrl_megatron_fixture\n"
    )
    (root / "site" / "nrl_megatron_fixture.py").write_text(textwrap.dedent(FIXTURE_PLUGIN))


def _grpo(root: Path, *overrides: str) -> Path:
    """``nrl run grpo`` of CONFIG with the fixture plugin in ``root`` (logs/run, ckpt)."""
    install_fixture_plugin(root)
    (root / "grpo.yaml").write_text(CONFIG)
    nrl(
        root,
        "run",
        "grpo",
        "-q",
        "--config",
        str(root / "grpo.yaml"),
        f"logger.log_dir={root / 'logs'}",
        "logger.run_name=run",
        f"checkpointing.checkpoint_dir={root / 'ckpt'}",
        *overrides,
    )
    return root


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    return _grpo(tmp_path_factory.mktemp("grpo-megatron"))


def test_three_grpo_steps_train_the_megatron_policy(grpo_run):
    from nrl_megatron.convert import ModelShape, hf_to_megatron
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.tiny import resolve_model_name

    lines = (grpo_run / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    # Step 0 holds what loading the data counted (no warm-up, no validation in this run).
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[0]["data/prompts_dropped_overlong"] == 0
    for record in records[1:]:
        # Generation and training logprobs come from the same Megatron forward: ratio ~1.
        assert record["train/gen_logprob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["train/env_errors"] == 0
        assert 0 < record["train/reward_mean"] < 1
        assert record["train/grad_norm"] > 0
        assert record["timing/generation_s"] > 0

    # One file per rank; both data-parallel replicas hold the same, trained, weights.
    policy = grpo_run / "ckpt" / "step_3" / "policy"
    assert sorted(p.name for p in policy.iterdir()) == ["rank0.pt", "rank1.pt"]
    states = [torch.load(policy / f"rank{r}.pt", weights_only=False)["model"] for r in (0, 1)]
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_name("tiny"))
    initial = hf_to_megatron(hf.state_dict(), ModelShape.from_hf_config(hf.config))
    changed = [k for k, v in initial.items() if not torch.equal(v, states[0][k])]
    assert len(changed) > len(initial) // 2
    assert all(torch.equal(states[0][k], states[1][k]) for k in initial)


def test_convert_exports_the_same_logits(grpo_run, pool2, start_group):
    from transformers import AutoModelForCausalLM

    out = grpo_run / "hf"
    done = nrl(grpo_run, "convert", str(grpo_run / "ckpt"), "--to", "hf", str(out))
    assert f"wrote {out}" in done.stdout
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    # The checkpoint loaded into Megatron ranks (same layout as the run: 2 data-parallel ranks).
    config = make_config("tiny")
    group = start_group(pool2, WORKER, (megatron_options(), context(config)))
    group.run_all("load_checkpoint", str(grpo_run / "ckpt" / "step_3" / "policy"))
    batch = make_batch(6, seed=7)
    want = Policy.from_config(group, config.policy).get_logprobs(batch)

    got = hf_logprobs(exported, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # A megatron checkpoint does not reshard: a different rank count is a one-line error.
    env = {**os.environ, "NRL_ACTOR_ENV": "system", "PYTHONPATH": str(grpo_run / "site")}
    # A new OUT_DIR: convert refuses a non-empty one before anything else (issue 47).
    fresh = out.parent / f"{out.name}-resharded"
    command = [sys.executable, "-m", "nrl_core.cli", "convert", str(grpo_run / "ckpt"), str(fresh)]
    refused = subprocess.run(
        [*command, "--num-workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert refused.returncode != 0
    assert "cannot be resharded; drop --num-workers or pass --num-workers 2" in refused.stderr


@pytest.mark.slow
def test_three_grpo_steps_over_two_pipeline_stages(tmp_path, pool1, start_group):
    """Issue 37's command: 2 pipeline stages (Megatron-Core's schedule over gloo), a separate
    torch engine refitted from both stages after every step (colocated generation would need
    the whole model on a rank), then ``nrl convert`` of the 2-stage checkpoint. The run took
    91 s on 2 shared cores (2026-11-26)."""
    root = _grpo(
        tmp_path,
        "policy.megatron.pipeline_model_parallel_size=2",
        "generation.torch.colocated=false",
    )
    lines = (root / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        # The engine's logprobs equal the trainer's: it received every stage's weights.
        assert record["train/gen_logprob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["train/grad_norm"] > 0
        assert record["timing/refit_s"] > 0
    # One file per rank: rank 0 holds the first stage's layers, rank 1 the last stage's.
    policy = root / "ckpt" / "step_3" / "policy"
    states = [torch.load(policy / f"rank{r}.pt", weights_only=False)["model"] for r in (0, 1)]
    assert "embedding.word_embeddings.weight" in states[0]
    assert "output_layer.weight" in states[1] and "output_layer.weight" not in states[0]

    # `nrl convert` of the 2-stage checkpoint equals the Hugging Face folder a one-stage policy
    # writes after loading the same checkpoint (resharded from 2 stages to 1).
    out = root / "hf"
    done = nrl(root, "convert", str(root / "ckpt"), "--to", "hf", str(out))
    assert f"wrote {out}" in done.stdout
    group = start_group(pool1, WORKER, (megatron_options(), context(make_config("tiny"))))
    group.run_all("load_checkpoint", str(policy))
    group.run_all("export_hf", str(root / "hf-one-stage"))
    converted = load_file(str(out / "model.safetensors"))
    one_stage = load_file(str(root / "hf-one-stage" / "model.safetensors"))
    assert converted.keys() == one_stage.keys()
    for name, tensor in one_stage.items():
        assert torch.equal(converted[name], tensor), name


@pytest.mark.slow
def test_three_grpo_steps_with_lora_refit_only_the_adapters(tmp_path, pool1, start_group):
    """Issue 52 item 2: ``nrl run grpo`` with the Megatron policy at ``lora_rank=8`` and a
    separate torch engine (``generation.lora_refit``'s ``auto``: adapters): each step's refit
    moves the rank-8 adapters' float32 bytes, not the model's (the merged figure), and the
    engine's logprobs, with the new adapter applied by peft, equal the trainer's. Then
    ``nrl convert`` of the LoRA checkpoint writes the merged model, and with ``--lora adapters``
    a PEFT folder that peft loads on the base model: both give the logprobs of the policy that
    loads the checkpoint. One policy rank, so the run is in the ``nrl`` process without Ray
    (the refit, convert and export do not depend on the rank count; LoRA over tensor, pipeline
    and data-parallel ranks is test_lora.py's)."""
    import math

    from transformers import AutoModelForCausalLM

    from nrl_core.testing.tiny import lora_adapter_bytes, resolve_model_name

    root = _grpo(
        tmp_path,
        "policy.megatron.lora_rank=8",
        "generation.torch.colocated=false",
        "policy.num_workers=1",
    )
    lines = (root / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines][1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    adapter_bytes = lora_adapter_bytes(rank=8)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_name("tiny"))
    merged_bytes = sum(t.numel() * 4 for t in hf.state_dict().values())
    print(f"refit/bytes adapters={adapter_bytes} merged={merged_bytes}")
    assert adapter_bytes < merged_bytes / 5
    for row in steps:
        assert row["refit/bytes"] == adapter_bytes, row
        assert row["train/gen_logprob_error_max"] < math.exp(1e-4), row
        assert row["train/grad_norm"] > 0

    out = root / "hf"
    done = nrl(root, "convert", str(root / "ckpt"), "--to", "hf", str(out))
    assert f"wrote {out}" in done.stdout
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    config = make_config("tiny")
    options = megatron_options()
    options.lora_rank = 8
    group = start_group(pool1, WORKER, (options, context(config)))
    group.run_all("load_checkpoint", str(root / "ckpt" / "step_3" / "policy"))
    batch = make_batch(6, seed=7)
    want = Policy.from_config(group, config.policy).get_logprobs(batch)
    got = hf_logprobs(exported, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    plain = hf_logprobs(hf, batch)
    assert (plain - want).abs().max() > 1e-5  # the adapters trained: not the base model

    # The adapters alone (issue 52: `nrl convert` exports adapters from both backends).
    from peft import PeftModel

    adapters = root / "adapters"
    nrl(root, "convert", str(root / "ckpt"), str(adapters), "--lora", "adapters")
    assert {p.name for p in adapters.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name("tiny"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapters).eval()
    got = hf_logprobs(peft_model, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
