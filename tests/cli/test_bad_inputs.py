"""Every bad input is refused in ONE line, before anything starts (issue 14, part E).

A table of bad inputs to ``nrl``: config values out of range, contradicting settings, unknown
components, broken config files, models, tokenizers, data files, checkpoints, output folders
and metrics files. Each must end with exit code 2 and exactly one stderr line ``error: ...``
that names the key or the file, with no traceback, within 10 s, and without Ray starting.

Most cases run in this process through ``nrl_core.cli.main`` (fast); a few run the real entry
point in a subprocess (``python -m nrl_core.cli``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nrl_core.cli import main

CASE_BUDGET_S = 10.0


class RayStarted(BaseException):
    """Raised by the tripwire on ``ray.init``: a bad input got past every check.

    A BaseException, so that no ``except Exception`` on the way can swallow it."""


# -- the files the cases point at ----------------------------------------------------------------


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def _model_copy(tiny, dest, drop=()):
    shutil.copytree(tiny, dest)
    for pattern in drop:
        for path in dest.glob(pattern):
            path.unlink()


def _damaged_checkpoints(d):
    """A checkpoint whose trainer state is not JSON, and one whose weights file was cut short
    after its manifest recorded the full size."""
    _write(d / "ckpt_corrupt" / "step_3" / "trainer_state.json", '{"step": 3, "rng":')
    step = d / "ckpt_trunc" / "step_2"
    _write(step / "policy" / "__0_0.distcp", os.urandom(4096))
    _write(step / "trainer_state.json", json.dumps({"step": 2}))
    try:
        from nrl_core.checkpoint import write_manifest
    except ImportError:  # an older nrl without manifests: the state file alone
        pass
    else:
        write_manifest(step)
    with (step / "policy" / "__0_0.distcp").open("r+b") as handle:
        handle.truncate(100)


def _hostile_checkpoints(d):
    """Issue 40: checkpoints that reach outside their folder (a symlinked shard, a symlinked
    policy/, a manifest entry ../outside), trainer states that are not nrl's (a negative step,
    a Python RNG state that is a number, a data position that is text, JSON nested 200,000
    deep), and a shard cut short with no manifest to tell."""
    from nrl_core.checkpoint import write_manifest

    outside = _write(d / "outside" / "secret.bin", b"x" * 64)
    state = json.dumps({"step": 2})

    def step(name, files, manifest=True):
        folder = d / name / "step_2"
        _write(folder / "trainer_state.json", files.pop("trainer_state.json", state))
        for rel, content in files.items():
            if isinstance(content, Path):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).symlink_to(content)
            else:
                _write(folder / rel, content)
        if manifest:
            write_manifest(folder)
        return folder

    step("ckpt_link_shard", {"policy/__0_0.distcp": outside})
    step("ckpt_link_policy", {"policy": outside.parent})
    dotdot = step("ckpt_dotdot", {"policy/__0_0.distcp": b"y" * 16})
    manifest = json.loads((dotdot / "manifest.json").read_text())
    manifest["files"]["../../outside/secret.bin"] = manifest["files"].pop("policy/__0_0.distcp")
    (dotdot / "manifest.json").write_text(json.dumps(manifest))
    step("ckpt_negative_step", {"trainer_state.json": json.dumps({"step": -7})})
    python_rng = json.dumps({"step": 2, "rng": {"python": 5}})
    step("ckpt_rng_number", {"trainer_state.json": python_rng})
    step("ckpt_epoch_text", {"trainer_state.json": json.dumps({"step": 2, "data": {"epoch": "x"}})})
    deep = '{"step": 2, "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    step("ckpt_deep_state", {"trainer_state.json": deep}, manifest=False)


def _dcp_offsets_checkpoint(d):
    """Issue 40: a real torch.distributed.checkpoint whose ``.metadata`` says its tensor lies
    at byte 10^12 of a 2 kB shard (manifest rewritten to match)."""
    import pickle
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from nrl_core.checkpoint import write_manifest

    step = d / "ckpt_offsets" / "step_2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assumes a single-process save"
        dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=str(step / "policy"))
    _write(step / "trainer_state.json", json.dumps({"step": 2}))
    metadata = pickle.loads((step / "policy" / ".metadata").read_bytes())  # written just now
    for info in metadata.storage_data.values():
        info.offset = 10**12
    (step / "policy" / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(step)


def _checkpoint_without_lora(d):
    """Issue 52 (h-dtlora): a step folder whose saved config is the sft recipe's, without LoRA
    (its policy files are never read: `--lora adapters` is refused first)."""
    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.checkpoint import write_manifest
    from nrl_core.config.loader import dump_config, resolve_config
    from nrl_core.plugins import PluginHost

    registry = PluginHost.discover().registry()
    config = resolve_config("sft", None, [], registry, defaults=default_recipe("sft"))
    step = d / "ckpt_no_lora" / "step_2"
    _write(step / "trainer_state.json", json.dumps({"step": 2}))
    _write(step / "config.yaml", dump_config(config, registry))
    _write(step / "policy" / "__0_0.distcp", b"z" * 16)
    write_manifest(step)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A folder of broken inputs (and a few good ones), shared by the cases."""
    from nrl_core.testing.tiny import tiny_model_path

    d = tmp_path_factory.mktemp("bad-inputs")
    tiny = tiny_model_path()
    # Config files.
    _write(d / "binary.yaml", b"\x7fELF\x02\x01\x01\x00\x00\x00seed: 1\n")
    _write(d / "latin1.yaml", b"seed: 1\nlogger:\n  run_name: caf\xe9\n")
    _write(d / "list.yaml", "- seed\n- 1\n")
    _write(d / "scalar.yaml", "just some words\n")
    _write(d / "unclosed.yaml", "policy:\n  optimizer: {lr: [1, 2\n")
    _write(d / "typo.yaml", "polcy:\n  model_name: tiny\n")
    _write(d / "cycle_a.yaml", "defaults: cycle_b.yaml\n")
    _write(d / "cycle_b.yaml", "defaults: cycle_a.yaml\n")
    _write(d / "int_keys.yaml", "1: one\n")
    (d / "conf_dir").mkdir()
    # Model and tokenizer folders.
    (d / "empty_model").mkdir()
    _model_copy(tiny, d / "no_weights", ["*.safetensors"])
    _model_copy(tiny, d / "no_tokenizer", ["tokenizer*", "chat_template*"])
    _model_copy(tiny, d / "broken_config")
    _write(d / "broken_config" / "config.json", '{"model_type": "llama",')
    _model_copy(tiny, d / "dense_model")  # a good dense model (issue 52: router replay)
    _write(d / "model.bin", b"\x00" * 64)
    # Data files.
    good = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(20)]
    _write(d / "good.jsonl", _jsonl(good))
    _write(d / "empty.jsonl", "")
    _write(d / "blank.jsonl", "\n\n  \n")
    _write(d / "notjson.jsonl", _jsonl(good[:3]) + "{problem: 1+1}\n")
    _write(d / "listline.jsonl", _jsonl(good[:2]) + '["1+1", "2"]\n')
    _write(d / "nofield.jsonl", _jsonl([{"question": "1+1", "answer": "2"}]))
    _write(d / "numeric.jsonl", _jsonl([*good[:1], {"problem": 11, "answer": "2"}]))
    _write(d / "binary.jsonl", _jsonl(good[:1]).encode() + b"\xff\xfe\x00\x01\n")
    _write(d / "val_list.jsonl", "[1, 2, 3]\n")
    _write(d / "chat_numeric.jsonl", _jsonl([{"messages": [{"role": "user", "content": 7}]}]))
    _write(d / "chat_user_only.jsonl", _jsonl([{"messages": [{"role": "user", "content": "hi"}]}]))
    _write(d / "pref_no_rejected.jsonl", _jsonl([{"prompt": "hi", "chosen": "hello"}]))
    _write(d / "pref_number.jsonl", "42\n")
    (d / "data_dir.jsonl").mkdir()
    # Output folders, checkpoints, metrics.
    _write(d / "afile", "not a folder\n")
    (d / "out_dir").mkdir()
    _damaged_checkpoints(d)
    _hostile_checkpoints(d)
    _dcp_offsets_checkpoint(d)
    _checkpoint_without_lora(d)
    os.mkfifo(d / "fifo.yaml")
    os.mkfifo(d / "fifo.jsonl")
    _write(d / "dup.yaml", "grpo:\n  max_num_steps: 3\nseed: 1\ngrpo:\n  val_period: 2\n")
    _write(d / "defaults_zero.yaml", "defaults: /dev/zero\n")
    _write(d / "plot_garbage" / "metrics.jsonl", 'garbage\n{"step": 1, "train/loss": 1.0}\n')
    _write(d / "plot_binary" / "metrics.jsonl", b'{"step": 1}\n\xff\xfe\n{"step": 2}\n')
    _write(d / "plot_empty" / "metrics.jsonl", "")
    _write(d / "plot_no_steps" / "metrics.jsonl", '[1, 2]\n{"train/loss": "high"}\n')
    (d / "plot_dir" / "metrics.jsonl").mkdir(parents=True)
    (d / "plot_none").mkdir()
    # Issue 40, data rows: a lone surrogate, NaN and `true` as answers, a key twice, a blank
    # problem (written by hand: json.dumps writes neither NaN rows nor duplicate keys).
    _write(d / "surrogate.jsonl", _jsonl(good[:1]) + '{"problem": "1+\\ud800", "answer": "2"}\n')
    _write(d / "answer_nan.jsonl", _jsonl(good[:2]) + '{"problem": "1+1", "answer": NaN}\n')
    _write(d / "answer_true.jsonl", _jsonl([{"problem": "1+1", "answer": True}]))
    _write(d / "dup_key.jsonl", '{"problem": "1+1", "answer": "2", "problem": "2+2"}\n')
    _write(d / "blank_problem.jsonl", _jsonl([*good[:1], {"problem": "  ", "answer": "2"}]))
    # Issue 40: one 5 MB prompt (tokenising it took about a minute; a 50 MB one, minutes).
    _write(d / "huge_line.jsonl", _jsonl([{"problem": "1+" * 2_500_000, "answer": "2"}]))
    _write(d / "answer_5000_digits.jsonl", '{"problem": "1+1", "answer": ' + "9" * 5000 + "}\n")
    _write(d / "deep.yaml", "grpo: " + "[" * 20_000 + "]" * 20_000 + "\n")
    # Issue 47, h-convert: OUT_DIRs that `nrl convert` must not write over.
    _write(d / "convert_out_full" / "mine.txt", "mine\n")
    (d / "convert_out_link").symlink_to(d / "outside")
    (d / "convert_out_link_to_file").symlink_to(d / "afile")
    _issue_47_config(d, tiny)
    return d


def _issue_47_config(d, tiny):
    """Issue 47 (h-config): empty and comment-only configs, an alias bomb, model folders that
    failed only in the workers (config.json nested 100k deep or of an unknown model type,
    weights cut short or not safetensors, a chat template jinja2's sandbox refuses), and
    trainer states with an unknown key or of 330 MB."""
    _write(d / "empty.yaml", "")
    _write(d / "comments.yaml", "# settings to come\n\n   # later\n")
    bomb = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    _write(d / "bomb.yaml", "\n".join(bomb) + "\ngrpo: {max_num_steps: *a8}\n")
    _model_copy(tiny, d / "deep_config")
    _write(d / "deep_config" / "config.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _model_copy(tiny, d / "unknown_type")
    config = json.loads((d / "unknown_type" / "config.json").read_text())
    _write(d / "unknown_type" / "config.json", json.dumps({**config, "model_type": "nosuchmodel"}))
    _model_copy(tiny, d / "cut_weights")
    weights = (d / "cut_weights" / "model.safetensors").read_bytes()
    _write(d / "cut_weights" / "model.safetensors", weights[: len(weights) // 2])
    _model_copy(tiny, d / "garbage_weights")
    _write(d / "garbage_weights" / "model.safetensors", b"\xff" * 4096)
    _model_copy(tiny, d / "sandbox_template")
    refused = "{{ ''.__class__.__mro__ }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    _write(d / "sandbox_template" / "chat_template.jinja", refused)
    junk = d / "ckpt_state_junk" / "step_2"
    _write(junk / "trainer_state.json", json.dumps({"step": 2, "junk": "x" * 1000}))
    from nrl_core.checkpoint import write_manifest

    write_manifest(junk)
    huge = d / "ckpt_state_huge" / "step_2"
    _write(huge / "trainer_state.json", json.dumps({"step": 2, "junk": 0}))
    with (huge / "trainer_state.json").open("r+b") as handle:
        handle.truncate(330_000_000)  # sparse: 330 MB on paper, nothing on disk


# -- the cases -----------------------------------------------------------------------------------

# (id, argv after `nrl` with {d} for the inputs folder, text the one line must hold, env)
# `run`/`eval` cases get logger.log_dir=<the test's own folder>/runs and
# checkpointing.enabled=false first (a case's own overrides come later and win).


def run(algorithm, *overrides):
    return ["run", algorithm, *overrides]


def show(algorithm, *overrides):
    return ["config", "show", algorithm, *overrides]


def evaluate(*overrides):
    return ["eval", *overrides]


VLLM = "generation.backend=vllm"
SGLANG = "generation.backend=sglang"
OFFLINE = {"HF_HUB_OFFLINE": "1"}

CASES = [
    # Numeric fields below their minimum (and above their maximum where there is one).
    ("seed", run("grpo", "seed=-1"), "seed must be >= 0, got -1", {}),
    ("num_workers", run("grpo", "policy.num_workers=0"), "policy.num_workers must be >= 1, got 0", {}),
    ("global_batch_0", run("grpo", "policy.train_global_batch_size=0"), "policy.train_global_batch_size must be >= 1, got 0", {}),
    ("global_batch_neg", run("sft", "policy.train_global_batch_size=-8"), "policy.train_global_batch_size must be >= 1, got -8", {}),
    ("micro_batch", run("grpo", "policy.train_micro_batch_size=0"), "policy.train_micro_batch_size must be >= 1", {}),
    ("token_budget", run("sft", "policy.micro_batch_token_budget=0"), "policy.micro_batch_token_budget must be >= 1 or null, got 0", {}),
    ("sequence_packing", run("grpo", "policy.sequence_packing=maybe"), "policy.sequence_packing must be one of auto, true, false, got 'maybe'", {}),
    ("logprob_batch", run("grpo", "policy.logprob_batch_size=-1"), "policy.logprob_batch_size must be >= 1", {}),
    ("max_seq_len", run("grpo", "policy.max_total_sequence_length=0"), "policy.max_total_sequence_length must be in [1, 16777216], got 0", {}),
    ("grad_norm", run("grpo", "policy.max_grad_norm=-1"), "policy.max_grad_norm must be >= 0", {}),
    ("lr_negative", run("grpo", "policy.optimizer.lr=-1"), "policy.optimizer.lr must be > 0, got -1", {}),
    ("lr_zero", run("sft", "policy.optimizer.lr=0"), "policy.optimizer.lr must be > 0, got 0", {}),
    ("weight_decay", run("grpo", "policy.optimizer.weight_decay=-0.1"), "policy.optimizer.weight_decay must be >= 0, got -0.1", {}),
    ("adam_eps", run("grpo", "policy.optimizer.eps=0"), "policy.optimizer.eps must be > 0", {}),
    ("warmup", run("grpo", "policy.optimizer.warmup_steps=-2"), "policy.optimizer.warmup_steps must be >= 0", {}),
    ("betas_above_max", run("grpo", "policy.optimizer.betas=[0.9,1.5]"), "policy.optimizer.betas must be two numbers in [0, 1)", {}),
    ("optimizer_name", run("grpo", "policy.optimizer.name=lion"), "policy.optimizer.name must be one of adamw, sgd, got 'lion'", {}),
    ("precision", run("grpo", "policy.precision=float8"), "policy.precision must be one of float32, bfloat16, got 'float8'", {}),
    ("max_new_tokens_0", run("grpo", "generation.max_new_tokens=0"), "generation.max_new_tokens must be >= 1, got 0", {}),
    ("max_new_tokens_neg", evaluate("generation.max_new_tokens=-5"), "generation.max_new_tokens must be >= 1, got -5", {}),
    ("temperature", run("grpo", "generation.temperature=-1"), "generation.temperature must be >= 0, got -1", {}),
    ("top_p_above_max", run("grpo", "generation.top_p=2"), "generation.top_p must be in (0, 1], got 2", {}),
    ("top_p_zero", run("grpo", "generation.top_p=0"), "generation.top_p must be in (0, 1], got 0", {}),
    ("top_k", run("grpo", "generation.top_k=-1"), "generation.top_k must be >= 0", {}),
    ("stop_token_ids", run("grpo", "generation.stop_token_ids=[2,-1]"), "generation.stop_token_ids must be a list of items >= 0", {}),
    ("stop_strings", run("grpo", 'generation.stop_strings=[""]'), "generation.stop_strings must be a list of non-empty strings", {}),
    ("env_workers", run("grpo", "env.num_workers=0"), "env.num_workers must be >= 1", {}),
    ("env_step_timeout", run("grpo", "env.step_timeout_s=0"), "env.step_timeout_s must be > 0, got 0", {}),
    ("val_fraction_above_max", run("grpo", "data.val_fraction=1.5"), "data.val_fraction must be in [0, 1), got 1.5", {}),
    ("val_fraction_neg", run("sft", "data.val_fraction=-0.1"), "data.val_fraction must be in [0, 1)", {}),
    ("max_val_samples", run("grpo", "data.max_val_samples=0"), "data.max_val_samples must be >= 1", {}),
    ("num_cpus", run("grpo", "cluster.num_cpus=0"), "cluster.num_cpus must be >= 1 or null, got 0", {}),
    ("gpus_per_node", run("grpo", "cluster.gpus_per_node=-1"), "cluster.gpus_per_node must be >= 0 or null", {}),
    ("worker_timeout", run("grpo", "cluster.worker_timeout_s=-5"), "cluster.worker_timeout_s must be > 0", {}),
    ("save_period", run("grpo", "checkpointing.save_period=0"), "checkpointing.save_period must be >= 1", {}),
    ("keep_last", run("grpo", "checkpointing.keep_last=0"), "checkpointing.keep_last must be >= 1 or null", {}),
    ("metric_name", run("grpo", "checkpointing.metric_name=accuracy"), "checkpointing.metric_name must be a `val/...` metric name", {}),
    ("lr_decay_unsized", run("grpo", "policy.optimizer.decay=cosine", "policy.optimizer.decay_steps=null"), "decay=cosine needs decay_steps", {}),
    ("lr_decay_name", run("grpo", "policy.optimizer.decay=exponential"), "policy.optimizer.decay must be one of", {}),
    ("lr_min_ratio", run("grpo", "policy.optimizer.min_lr_ratio=2"), "policy.optimizer.min_lr_ratio must be in [0, 1]", {}),
    ("sample_period", run("grpo", "logger.sample_period=-1"), "logger.sample_period must be >= 0", {}),
    ("run_name_empty", run("grpo", "logger.run_name="), "logger.run_name must be a non-empty string", {}),
    ("grpo_steps", run("grpo", "grpo.max_num_steps=-1"), "grpo.max_num_steps must be >= 0, got -1", {}),
    ("prompts_per_step", run("grpo", "grpo.num_prompts_per_step=0"), "grpo.num_prompts_per_step must be in [1, 1048576], got 0", {}),
    ("generations_0", run("grpo", "grpo.num_generations_per_prompt=0"), "grpo.num_generations_per_prompt must be >= 2, got 0", {}),
    ("generations_1", run("grpo", "grpo.num_generations_per_prompt=1"), "grpo.num_generations_per_prompt must be >= 2, got 1", {}),
    ("rollout_turns", run("grpo", "grpo.max_rollout_turns=0"), "grpo.max_rollout_turns must be >= 1", {}),
    ("val_period", run("grpo", "grpo.val_period=-1"), "grpo.val_period must be >= 0", {}),
    ("dynamic_batches", run("grpo", "grpo.dynamic_sampling_max_batches=-1"), "grpo.dynamic_sampling_max_batches must be >= 0", {}),
    ("sft_warmup", run("grpo", "grpo.sft_warmup_steps=-3"), "grpo.sft_warmup_steps must be >= 0", {}),
    ("sft_steps", run("sft", "sft.max_num_steps=-1"), "sft.max_num_steps must be >= 0", {}),
    ("sft_val_period", show("sft", "sft.val_period=-2"), "sft.val_period must be >= 0", {}),
    ("dpo_beta", run("dpo", "dpo.beta=0"), "dpo.beta must be > 0, got 0", {}),
    ("dpo_sft_weight", run("dpo", "dpo.sft_loss_weight=-1"), "dpo.sft_loss_weight must be >= 0", {}),
    ("rm_steps", run("rm", "rm.max_num_steps=-1"), "rm.max_num_steps must be >= 0", {}),
    ("eval_samples", evaluate("eval.num_samples=0"), "eval.num_samples must be >= 1, got 0", {}),
    ("eval_batch", evaluate("eval.batch_size=-1"), "eval.batch_size must be >= 0", {}),
    ("eval_turns", evaluate("eval.max_rollout_turns=0"), "eval.max_rollout_turns must be >= 1", {}),
    ("eval_pass_k", evaluate("eval.pass_k=[0]"), "eval.pass_k must be a list of items >= 1", {}),
    # Component options.
    ("clip_low_above_max", run("grpo", "loss.clipped_pg.clip_eps_low=1.5"), "loss.clipped_pg.clip_eps_low must be in [0, 1], got 1.5", {}),
    ("kl_coef", run("grpo", "loss.clipped_pg.kl_coef=-1"), "loss.clipped_pg.kl_coef must be >= 0", {}),
    ("dual_clip", run("grpo", "loss.clipped_pg.dual_clip_c=0.5"), "loss.clipped_pg.dual_clip_c must be > 1 (commonly 3) or null, got 0.5", {}),
    ("kl_estimator", run("grpo", "loss.clipped_pg.kl_estimator=k9"), "loss.clipped_pg.kl_estimator must be one of k1, k2, k3, got 'k9'", {}),
    ("nll_aggregation", run("sft", "loss.nll.aggregation=sum"), "loss.nll.aggregation must be one of token_mean", {}),
    ("tensor_parallel", run("grpo", "policy.dtensor.tensor_parallel_size=0"), "policy.dtensor.tensor_parallel_size must be >= 1", {}),
    ("data_parallel", run("grpo", "policy.dtensor.data_parallel=mirror"), "policy.dtensor.data_parallel must be one of auto, shard, replicate, got 'mirror'", {}),
    ("replicate_with_tp", run("grpo", "policy.dtensor.data_parallel=replicate", "policy.dtensor.tensor_parallel_size=2"), "policy.dtensor: data_parallel=replicate does not combine with tensor_parallel_size > 1", {}),
    ("replicate_with_offload", run("grpo", "policy.dtensor.data_parallel=replicate", "policy.dtensor.cpu_offload=true"), "policy.dtensor: cpu_offload is FSDP2's offload of sharded weights", {}),
    ("lora_rank", run("sft", "policy.dtensor.lora_rank=-1"), "policy.dtensor.lora_rank must be >= 0", {}),
    ("lora_dropout_above_max", run("sft", "policy.dtensor.lora_dropout=1"), "policy.dtensor.lora_dropout must be in [0, 1), got 1", {}),
    ("torch_gen_batch", run("grpo", "generation.torch.generation_batch_size=0"), "generation.torch.generation_batch_size must be in [1, 65536], got 0", {}),
    ("vllm_memory_above_max", run("grpo", VLLM, "generation.vllm.gpu_memory_utilization=1.5"), "generation.vllm.gpu_memory_utilization must be in (0, 1] or null, got 1.5", {}),
    ("vllm_sleep_level", run("grpo", VLLM, "generation.vllm.sleep_level=3"), "generation.vllm.sleep_level must be one of 1, 2, got 3", {}),
    ("vllm_dtype", run("grpo", VLLM, "generation.vllm.dtype=auto"), "generation.vllm.dtype must be one of bfloat16, float16, float32", {}),
    ("sglang_transport", run("grpo", SGLANG, "generation.sglang.refit_transport=pigeon"), "generation.sglang.refit_transport must be one of auto, cuda_ipc, nccl, shm", {}),
    ("sglang_memory_above_max", run("grpo", SGLANG, "generation.sglang.mem_fraction_static=2"), "generation.sglang.mem_fraction_static must be in (0, 1]", {}),
    ("megatron_pp", run("sft", "policy.backend=megatron", "policy.megatron.pipeline_model_parallel_size=0"), "policy.megatron.pipeline_model_parallel_size must be >= 1", {}),
    ("math_timeout", run("grpo", "env.name=math", "env.math.timeout_s=0"), "env.math.timeout_s must be > 0", {}),
    ("math_verify_fn", run("grpo", "env.name=math", "env.math.verify_fn=not-a-target"), "env.math.verify_fn must be `module:function`", {}),
    ("arith_digits", run("grpo", "data.arithmetic.num_digits=0"), "data.arithmetic.num_digits must be >= 1", {}),
    ("arith_train_size", run("grpo", "data.arithmetic.train_size=0"), "data.arithmetic.train_size must be >= 1", {}),
    ("guess_turns", run("grpo", "env.name=guess_number", "env.guess_number.max_turns=0"), "env.guess_number.max_turns must be >= 1", {}),
    ("guess_low_high", run("grpo", "data.dataset=guess_number", "data.guess_number.low=10", "data.guess_number.high=1"), "data.guess_number: high (1) must be at least low (10)", {}),
    ("chat_max_samples", run("sft", "data.chat.max_samples=0"), "data.chat.max_samples must be >= 1 or null", {}),
    # Settings that contradict each other.
    ("no_room_for_prompt", run("grpo", "generation.max_new_tokens=48"), "generation.max_new_tokens=48 leaves no room for a prompt in policy.max_total_sequence_length=48", {}),
    ("no_room_eval", evaluate("generation.max_new_tokens=4096"), "generation.max_new_tokens=4096 leaves no room", {}),
    # Unknown components.
    ("policy_backend", run("grpo", "policy.backend=nope"), "policy.backend", {}),
    ("generation_backend", run("grpo", "generation.backend=nope"), "generation.backend", {}),
    ("loss_name", run("grpo", "loss.name=nope"), "loss.name", {}),
    ("env_name", evaluate("env.name=nope"), "env.name", {}),
    ("cluster_backend", run("sft", "cluster.backend=nope"), "cluster.backend", {}),
    ("data_dataset", run("dpo", "data.dataset=nope"), "data.dataset", {}),
    # Config files and overrides.
    ("config_missing", ["run", "grpo", "--config", "{d}/nope.yaml"], "config file {d}/nope.yaml does not exist", {}),
    ("config_binary", ["run", "grpo", "--config", "{d}/binary.yaml"], "config file {d}/binary.yaml is a binary file", {}),
    ("config_latin1", ["run", "sft", "--config", "{d}/latin1.yaml"], "config file {d}/latin1.yaml, line 3: not UTF-8", {}),
    ("config_list", ["run", "grpo", "--config", "{d}/list.yaml"], "{d}/list.yaml must hold a mapping of config keys", {}),
    ("config_scalar", show("grpo", "--config", "{d}/scalar.yaml"), "{d}/scalar.yaml must hold a mapping", {}),
    ("config_folder", ["eval", "--config", "{d}/conf_dir"], "config file {d}/conf_dir is a folder", {}),
    ("config_bad_yaml", ["run", "dpo", "--config", "{d}/unclosed.yaml"], "bad YAML in {d}/unclosed.yaml, line", {}),
    ("config_typo", ["run", "grpo", "--config", "{d}/typo.yaml"], "unknown key polcy; did you mean policy?", {}),
    ("config_cycle", ["run", "grpo", "--config", "{d}/cycle_a.yaml"], "defaults form a cycle", {}),
    ("config_int_keys", ["run", "grpo", "--config", "{d}/int_keys.yaml"], "{d}/int_keys.yaml: config keys are names", {}),
    ("override_type", run("grpo", "policy.optimizer.lr=fast"), "policy.optimizer.lr: expected float, got str 'fast'", {}),
    ("override_shape", run("grpo", "justakey"), "override 'justakey' must look like key.path=value", {}),
    # Model and tokenizer.
    ("model_missing", run("grpo", "policy.model_name={d}/no-such-model"), "policy.model_name={d}/no-such-model: no such folder", {}),
    ("model_empty_folder", run("sft", "policy.model_name={d}/empty_model"), "policy.model_name={d}/empty_model has no config.json", {}),
    ("model_no_weights", run("dpo", "policy.model_name={d}/no_weights"), "policy.model_name={d}/no_weights has no weights", {}),
    ("model_bad_config", evaluate("policy.model_name={d}/broken_config"), "policy.model_name={d}/broken_config: config.json is not valid JSON", {}),
    ("model_is_file", run("rm", "policy.model_name={d}/model.bin"), "policy.model_name={d}/model.bin is a file", {}),
    ("model_hub_offline", run("grpo", "policy.model_name=nrl-tests/no-such-model-h2"), "policy.model_name=nrl-tests/no-such-model-h2 is not a local folder and not in the Hugging Face cache", OFFLINE),
    ("tokenizer_missing_files", run("grpo", "policy.model_name={d}/no_tokenizer"), "policy.model_name={d}/no_tokenizer has no tokenizer files", {}),
    ("tokenizer_folder_empty", run("sft", "policy.tokenizer_name={d}/empty_model"), "policy.tokenizer_name={d}/empty_model has no tokenizer files", {}),
    ("actor_env_not_python", run("grpo", "policy.actor_env={d}/no-python"), "policy.actor_env={d}/no-python is not an executable Python interpreter", {}),
    ("cluster_actor_env_file", run("grpo", "cluster.actor_env={d}/afile"), "cluster.actor_env={d}/afile is not an executable Python interpreter", {}),
    # Data files: checked line by line when loaded, before Ray or any worker.
    ("data_missing", run("grpo", "data.dataset={d}/missing.jsonl"), "data.dataset={d}/missing.jsonl does not exist", {}),
    ("data_empty", run("grpo", "data.dataset={d}/empty.jsonl"), "data.dataset={d}/empty.jsonl is empty", {}),
    ("data_blank_lines", run("grpo", "data.dataset={d}/blank.jsonl"), "data file {d}/blank.jsonl is empty", {}),
    ("data_folder", run("grpo", "data.dataset={d}/data_dir.jsonl"), "data.dataset={d}/data_dir.jsonl is a folder", {}),
    ("data_not_json", run("grpo", "data.dataset={d}/notjson.jsonl"), "{d}/notjson.jsonl:4: not valid JSON", {}),
    ("data_list_line", run("grpo", "data.dataset={d}/listline.jsonl"), "{d}/listline.jsonl:3: expected a JSON object", {}),
    ("data_missing_field", run("grpo", "data.dataset={d}/nofield.jsonl"), "{d}/nofield.jsonl:1: no field 'problem'", {}),
    ("data_numeric_field", run("grpo", "data.dataset={d}/numeric.jsonl"), "{d}/numeric.jsonl:2: field 'problem' must be text", {}),
    ("data_not_utf8", run("grpo", "data.dataset={d}/binary.jsonl"), "{d}/binary.jsonl:2: not UTF-8", {}),
    ("val_missing", run("grpo", "data.dataset={d}/good.jsonl", "data.val_dataset={d}/nope.jsonl"), "data.val_dataset={d}/nope.jsonl does not exist", {}),
    ("val_list_line", evaluate("data.dataset={d}/good.jsonl", "data.val_dataset={d}/val_list.jsonl", "env.name=arithmetic"), "{d}/val_list.jsonl:1: expected a JSON object", {}),
    ("chat_missing", run("sft", "data.chat.path={d}/missing.jsonl"), "data.chat.path={d}/missing.jsonl does not exist", {}),
    ("chat_numeric_content", run("sft", "data.chat.path={d}/chat_numeric.jsonl"), "{d}/chat_numeric.jsonl:1: a message's 'role' and 'content' must be text", {}),
    ("chat_no_assistant", run("sft", "data.chat.path={d}/chat_user_only.jsonl"), "{d}/chat_user_only.jsonl:1 has no assistant message", {}),
    ("pref_no_rejected", run("dpo", "data.preference.path={d}/pref_no_rejected.jsonl"), "{d}/pref_no_rejected.jsonl:1 has no field 'rejected'", {}),
    ("pref_number_line", run("rm", "data.preference.path={d}/pref_number.jsonl"), "{d}/pref_number.jsonl:1: expected a JSON object", {}),
    # Output folders, checkpoints.
    ("log_dir_under_file", run("grpo", "logger.log_dir={d}/afile/runs"), "logger.log_dir={d}/afile/runs: {d}/afile is a file", {}),
    ("log_dir_unwritable", run("sft", "logger.log_dir=/proc/nrl-runs"), "logger.log_dir=/proc/nrl-runs: cannot create", {}),
    ("checkpoint_dir_under_file", run("grpo", "checkpointing.enabled=true", "checkpointing.checkpoint_dir={d}/afile/ck"), "checkpointing.checkpoint_dir={d}/afile/ck", {}),
    ("eval_output_folder", evaluate("eval.output={d}/out_dir"), "eval.output={d}/out_dir is a folder", {}),
    ("resume_missing", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ck/step_9"), "checkpointing.resume={d}/ck/step_9: no such folder", {}),
    ("resume_corrupt_state", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_corrupt/step_3"), "checkpointing.resume={d}/ckpt_corrupt/step_3", {}),
    ("resume_truncated", run("sft", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_trunc/step_2"), "checkpointing.resume={d}/ckpt_trunc/step_2", {}),
    ("eval_checkpoint_missing", evaluate("eval.checkpoint={d}/no-ckpt"), "{d}/no-ckpt", {}),
    ("convert_missing", ["convert", "{d}/no-ckpt", "{d}/converted"], "{d}/no-ckpt", {}),
    ("convert_corrupt", ["convert", "{d}/ckpt_corrupt/step_3", "{d}/converted"], "{d}/ckpt_corrupt/step_3", {}),
    # Issue 40: configs and checkpoints from a hostile probe.
    ("config_duplicate_key", ["run", "grpo", "--config", "{d}/dup.yaml"], "bad YAML in {d}/dup.yaml, line 4, column 1: duplicate key 'grpo' (also on line 1)", {}),
    ("config_fifo", ["run", "grpo", "--config", "{d}/fifo.yaml"], "config file {d}/fifo.yaml is not a regular file", {}),
    ("config_dev_zero", ["run", "grpo", "--config", "/dev/zero"], "config file /dev/zero is not a regular file", {}),
    ("config_defaults_dev_zero", ["run", "grpo", "--config", "{d}/defaults_zero.yaml"], "config file /dev/zero is not a regular file", {}),
    ("seed_22_digits", run("grpo", "seed=1234567890123456789012"), "seed must be <= 9223372036854775807, got 1234567890123456789012", {}),
    ("seed_5000_digits", run("grpo", "seed=" + "9" * 5000), "seed: expected int, got str '999", {}),
    ("lr_inf", run("grpo", "policy.optimizer.lr=.inf"), "policy.optimizer.lr must be > 0, got inf", {}),
    ("lr_1e400", run("sft", "policy.optimizer.lr=1e400"), "policy.optimizer.lr must be > 0, got inf", {}),
    ("temperature_inf", run("grpo", "generation.temperature=.inf"), "generation.temperature must be >= 0, got inf", {}),
    ("stop_strings_text", run("grpo", "generation.stop_strings=stop"), "generation.stop_strings: expected a list, got str 'stop'", {}),
    ("run_name_escapes", run("grpo", "logger.run_name=../../../x"), "logger.run_name must be a non-empty string naming one folder", {}),
    ("run_name_absolute", run("grpo", "logger.run_name=/tmp/x"), "logger.run_name must be a non-empty string naming one folder", {}),
    ("run_name_dot", run("grpo", "logger.run_name=."), "logger.run_name must be a non-empty string naming one folder", {}),
    ("run_name_newline", run("grpo", 'logger.run_name="a\\nb"'), "logger.run_name must be a non-empty string naming one folder", {}),
    ("data_fifo", run("grpo", "data.dataset={d}/fifo.jsonl"), "{d}/fifo.jsonl", {}),
    ("data_dev_zero", run("grpo", "data.dataset=/dev/zero"), "/dev/zero", {}),
    ("convert_out_unwritable", ["convert", "{d}/ckpt_link_shard/step_2", "/proc/nrl-out/hf"], "cannot write /proc/nrl-out/hf", {}),
    ("ckpt_symlinked_shard", ["convert", "{d}/ckpt_link_shard/step_2", "{d}/converted"], "policy/__0_0.distcp is a symbolic link", {}),
    ("ckpt_symlinked_policy", evaluate("eval.checkpoint={d}/ckpt_link_policy/step_2"), "policy is a symbolic link", {}),
    ("ckpt_manifest_dotdot", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_dotdot/step_2"), "manifest.json names '../../outside/secret.bin', outside the checkpoint folder", {}),
    ("ckpt_negative_step", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_negative_step/step_2"), "holds no integer `step` >= 0", {}),
    ("ckpt_rng_number", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_rng_number/step_2"), "`rng.python` is not a Python random state", {}),
    ("ckpt_epoch_text", ["convert", "{d}/ckpt_epoch_text/step_2", "{d}/converted"], "`data` must be the data stream's position", {}),
    ("ckpt_deep_state", ["convert", "{d}/ckpt_deep_state/step_2", "{d}/converted"], "is not a trainer state (JSON nested too deeply)", {}),
    ("ckpt_metadata_offsets", ["convert", "{d}/ckpt_offsets/step_2", "{d}/converted"], "policy/.metadata says __0_0.distcp holds bytes at offset 1000000000000 (length", {}),
    ("ckpt_metadata_offsets_resume", run("sft", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_offsets/step_2"), "outside the file's", {}),
    # Issue 40, round two: sizes and layouts that cannot run, refused before Ray.
    ("prompts_per_step_absurd", run("grpo", "grpo.num_prompts_per_step=10000000000"), "grpo.num_prompts_per_step must be in [1, 1048576], got 10000000000", {}),
    ("max_seq_len_absurd", run("grpo", "policy.max_total_sequence_length=100000000000"), "policy.max_total_sequence_length must be in [1, 16777216], got 100000000000", {}),
    ("torch_gen_batch_absurd", run("grpo", "generation.torch.generation_batch_size=100000000000000"), "generation.torch.generation_batch_size must be in [1, 65536], got 100000000000000", {}),
    ("micro_above_global", run("grpo", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=32"), "policy.train_micro_batch_size=32 is larger than policy.train_global_batch_size=16", {}),
    ("global_batch_uneven_dp", run("grpo", "policy.num_workers=2", "policy.train_global_batch_size=7", "policy.train_micro_batch_size=1"), "policy.train_global_batch_size=7 does not split evenly over the 2 data-parallel ranks", {}),
    ("tp_3_on_2_workers", run("grpo", "policy.num_workers=2", "policy.dtensor.tensor_parallel_size=3"), "policy.dtensor: tensor_parallel_size=3 must divide policy.num_workers=2", {}),
    ("tp_4_on_2_workers", run("sft", "policy.num_workers=2", "policy.dtensor.tensor_parallel_size=4"), "policy.dtensor: tensor_parallel_size=4 must divide policy.num_workers=2", {}),
    # Issue 37: pipeline and expert parallel sizes the ranks cannot hold.
    ("pp_3_on_2_workers", run("sft", "policy.backend=megatron", "policy.num_workers=2", "policy.megatron.pipeline_model_parallel_size=3"), "policy.megatron: pipeline_model_parallel_size=3 must divide policy.num_workers=2", {}),
    ("tp_pp_4_on_2_workers", run("sft", "policy.backend=megatron", "policy.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2", "policy.megatron.tensor_model_parallel_size=2"), "policy.megatron: tensor_model_parallel_size=2 x pipeline_model_parallel_size=2 must divide policy.num_workers=2", {}),
    ("pp_2_generating_in_the_policy", run("grpo", "policy.backend=megatron", "policy.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2"), "generation.backend=torch generates inside the policy workers, which pipeline stages split (policy.megatron pipeline size > 1); set generation.torch.colocated=false", {}),
    ("ep_4_on_2_dp_ranks", run("sft", "policy.backend=megatron", "policy.num_workers=2", "policy.megatron.expert_model_parallel_size=4"), "policy.megatron.expert_model_parallel_size=4 must divide the 2 data x context parallel ranks", {}),
    ("ep_2_with_pp_2_on_2_workers", run("sft", "policy.backend=megatron", "policy.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2", "policy.megatron.expert_model_parallel_size=2"), "policy.megatron.expert_model_parallel_size=2 must divide the 1 data x context parallel ranks", {}),
    ("policy_workers_on_2_cpus", run("grpo", "cluster.num_cpus=2", "policy.num_workers=64"), "policy.num_workers=64: the workers need at least 6.65 CPUs and the local cluster has 2", {}),
    ("env_workers_on_2_cpus", run("grpo", "cluster.num_cpus=2", "env.num_workers=50"), "env.num_workers=50: the workers need at least 12.7 CPUs and the local cluster has 2", {}),
    ("engines_on_2_cpus", run("grpo", "cluster.num_cpus=2", "generation.torch.colocated=false", "generation.torch.num_engines=40"), "generation.torch.num_engines=40: the workers need at least 20.45 CPUs and the local cluster has 2", {}),
    # More GPUs than any one machine has: the row holds on a GPU machine too.
    ("gpus_per_node_absent", run("grpo", "cluster.gpus_per_node=4096"), "cluster.gpus_per_node=4096, and this machine has", {}),
    ("algorithm_unknown", ["run", "ppoo"], "nrl run: argument ALGO: invalid choice: 'ppoo'", {}),
    ("env_warn_failed_zero", run("grpo", "env.warn_failed_fraction=0"), "env.warn_failed_fraction must be in (0, 1], got 0", {}),
    ("env_stop_failed_above_max", run("grpo", "env.stop_failed_fraction=1.5"), "env.stop_failed_fraction must be in (0, 1] or null, got 1.5", {}),
    # Issue 40, round two: data rows.
    ("data_lone_surrogate", run("grpo", "data.dataset={d}/surrogate.jsonl"), "{d}/surrogate.jsonl:2: field 'problem' holds a lone surrogate (\\ud800)", {}),
    ("data_answer_nan", run("grpo", "data.dataset={d}/answer_nan.jsonl"), "{d}/answer_nan.jsonl:3: field 'answer' holds NaN, which is not a JSON value", {}),
    ("data_answer_true", run("grpo", "data.dataset={d}/answer_true.jsonl"), "{d}/answer_true.jsonl:1: field 'answer' must be text or a number, got True", {}),
    ("data_duplicate_key", run("grpo", "data.dataset={d}/dup_key.jsonl"), "{d}/dup_key.jsonl:1: duplicate key 'problem'", {}),
    ("data_blank_problem", run("grpo", "data.dataset={d}/blank_problem.jsonl"), "{d}/blank_problem.jsonl:2: field 'problem' is blank", {}),
    ("data_huge_line", run("grpo", "data.dataset={d}/huge_line.jsonl"), "every one of the 1 training prompts of data.dataset={d}/huge_line.jsonl is longer than", {}),
    ("data_answer_5000_digits", run("grpo", "data.dataset={d}/answer_5000_digits.jsonl"), "{d}/answer_5000_digits.jsonl:1: a number with more than 4300 digits; write it as a string", {}),
    ("config_nested_20000", ["run", "grpo", "--config", "{d}/deep.yaml"], "bad YAML in {d}/deep.yaml: nested too deeply", {}),
    # Metrics for `nrl plot`.
    ("plot_no_run", ["plot", "{d}/plot_none"], "{d}/plot_none has no metrics.jsonl", {}),
    ("plot_missing_dir", ["plot", "{d}/not-a-run"], "{d}/not-a-run has no metrics.jsonl", {}),
    ("plot_metrics_is_folder", ["plot", "{d}/plot_dir"], "{d}/plot_dir has no metrics.jsonl", {}),
    ("plot_garbage_line", ["plot", "{d}/plot_garbage"], "{d}/plot_garbage/metrics.jsonl: metrics.jsonl line 1 is not JSON", {}),
    ("plot_binary_line", ["plot", "{d}/plot_binary"], "{d}/plot_binary/metrics.jsonl:2: not UTF-8", {}),
    ("plot_empty", ["plot", "{d}/plot_empty"], "{d}/plot_empty/metrics.jsonl holds no metrics", {}),
    ("plot_no_steps", ["plot", "{d}/plot_no_steps"], "{d}/plot_no_steps/metrics.jsonl holds no metrics", {}),
    # issue 47, h-convert
    ("convert_out_not_empty", ["convert", "{d}/no-ckpt", "{d}/convert_out_full"], "OUT_DIR {d}/convert_out_full is not empty (it holds mine.txt); name a new or empty folder, or pass --overwrite", {}),
    ("convert_out_symlink", ["convert", "{d}/no-ckpt", "{d}/convert_out_link"], "OUT_DIR {d}/convert_out_link is a symbolic link (to {d}/outside)", {}),
    ("convert_out_is_file", ["convert", "{d}/no-ckpt", "{d}/afile"], "OUT_DIR {d}/afile is a file; name a new or empty folder", {}),
    ("convert_out_link_to_file", ["convert", "{d}/no-ckpt", "{d}/convert_out_link_to_file", "--overwrite"], "OUT_DIR {d}/convert_out_link_to_file is a symbolic link to {d}/afile, which is not a folder", {}),
    ("nrl_path_dotdot", run("sft", "data.chat.path=nrl://" + "../" * 12 + "etc/passwd"), "data.chat.path=nrl://../../", {}),
    ("nrl_path_dotdot_inside", run("sft", "data.chat.path=nrl://recipes/../recipes/data/chat_train.jsonl"), "an nrl:// path names a file shipped inside nrl_core", {}),
    ("nrl_path_absolute", run("rm", "data.preference.path=nrl:///etc/passwd"), "data.preference.path=nrl:///etc/passwd: an nrl:// path names a file shipped inside nrl_core", {}),
    ("data_fifo_named", run("grpo", "data.dataset={d}/fifo.jsonl"), "data.dataset={d}/fifo.jsonl is a FIFO (named pipe), not a regular file", {}),
    ("data_dev_zero_named", run("grpo", "data.dataset=/dev/zero"), "data.dataset=/dev/zero is a character device, not a regular file", {}),
    ("data_val_dev_zero", run("grpo", "data.val_dataset=/dev/zero"), "data.val_dataset=/dev/zero is a character device, not a regular file", {}),
    ("chat_path_fifo", run("sft", "data.chat.path={d}/fifo.jsonl"), "data.chat.path={d}/fifo.jsonl is a FIFO (named pipe), not a regular file", {}),
    ("prompts_path_dev_zero", run("grpo", "data.dataset=prompts", "data.prompts.path=/dev/zero"), "data.prompts.path=/dev/zero is a character device, not a regular file", {}),
    # issue 47, h-config
    ("run_name_256_bytes", run("grpo", "logger.run_name=" + "x" * 256), "logger.run_name must be a non-empty string naming one folder (at most 255 bytes", {}),
    ("run_name_256_bytes_utf8", run("grpo", "logger.run_name=" + "\u00e9" * 128), "logger.run_name must be a non-empty string naming one folder (at most 255 bytes", {}),
    ("model_config_nested_100k", run("grpo", "policy.model_name={d}/deep_config"), "policy.model_name={d}/deep_config: {d}/deep_config/config.json is nested too deeply", {}),
    ("model_type_unknown", run("grpo", "policy.model_name={d}/unknown_type"), "policy.model_name={d}/unknown_type: {d}/unknown_type/config.json does not load as a model config", {}),
    ("model_weights_cut_short", run("sft", "policy.model_name={d}/cut_weights"), "policy.model_name={d}/cut_weights: {d}/cut_weights/model.safetensors is cut short", {}),
    ("model_weights_garbage", evaluate("policy.model_name={d}/garbage_weights"), "{d}/garbage_weights/model.safetensors is not a safetensors file", {}),
    ("chat_template_sandbox", run("grpo", "policy.model_name={d}/sandbox_template"), "the chat template of {d}/sandbox_template was refused by jinja2's sandbox", {}),
    ("chat_template_sandbox_sft", run("sft", "policy.model_name={d}/sandbox_template"), "the chat template of {d}/sandbox_template was refused by jinja2's sandbox", {}),
    ("config_empty", ["run", "grpo", "--config", "{d}/empty.yaml"], "config file {d}/empty.yaml holds no settings (it is empty or only comments)", {}),
    ("config_comments_only", ["run", "sft", "--config", "{d}/comments.yaml"], "config file {d}/comments.yaml holds no settings", {}),
    ("config_alias_bomb", ["run", "grpo", "--config", "{d}/bomb.yaml"], "bad YAML in {d}/bomb.yaml: its aliases (*name) repeat", {}),
    ("resume_with_checkpointing_off", run("grpo", "checkpointing.resume={d}/ckpt_state_junk/step_2"), "checkpointing.resume={d}/ckpt_state_junk/step_2 is ignored with checkpointing.enabled=false", {}),
    ("ckpt_state_unknown_key", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_state_junk/step_2"), "trainer_state.json: unknown key 'junk'", {}),
    ("ckpt_state_330_mb", run("grpo", "checkpointing.enabled=true", "checkpointing.resume={d}/ckpt_state_huge/step_2"), "trainer_state.json is 314 MiB, over the 4 MiB a trainer state may be", {}),
    ("ckpt_state_330_mb_convert", ["convert", "{d}/ckpt_state_huge/step_2", "{d}/converted"], "trainer_state.json is 314 MiB", {}),
    # issue 47, h-agents
    ("serve_network_no_api_key", ["serve", "--host", "0.0.0.0"], "server.host=0.0.0.0 serves the network and no API key is set: give --api-key KEY", {}),
    ("serve_network_no_api_key_override", ["serve", "server.host=::"], "server.host=:: serves the network and no API key is set", {}),
    ("serve_api_key_and_no_api_key", ["serve", "--host", "0.0.0.0", "--api-key", "k", "--no-api-key"], "argument --no-api-key: not allowed with argument --api-key", {}),
    # issue 49, h-algos
    ("cispo_not_bool", run("grpo", "loss.clipped_pg.use_cispo=maybe"), "loss.clipped_pg.use_cispo: expected bool, got str 'maybe'", {}),
    ("cispo_with_dual_clip", run("grpo", "loss.clipped_pg.use_cispo=true", "loss.clipped_pg.dual_clip_c=3"), "loss.clipped_pg: dual_clip_c caps the PPO surrogate, which use_cispo=true replaces", {}),
    ("cispo_with_sequence_ratio", run("grpo", "loss.clipped_pg.use_cispo=true", "loss.clipped_pg.ratio_level=sequence"), "loss.clipped_pg: use_cispo=true clips per-token importance weights and cannot be used with ratio_level=sequence", {}),
    ("estimator_unknown", run("grpo", "grpo.advantage_estimator=ppo"), "grpo.advantage_estimator must be one of grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, got 'ppo'", {}),
    ("reinforce_gamma_above_1", run("grpo", "grpo.advantage_estimator=reinforce_plus_plus", "grpo.gamma=1.5"), "grpo.gamma must be in [0, 1], got 1.5", {}),
    ("reinforce_gamma_negative", run("grpo", "grpo.advantage_estimator=reinforce_plus_plus_baseline", "grpo.gamma=-0.1"), "grpo.gamma must be in [0, 1], got -0.1", {}),
    ("reward_kl_negative", run("grpo", "grpo.advantage_estimator=reinforce_plus_plus", "grpo.reward_kl_coef=-1"), "grpo.reward_kl_coef must be >= 0, got -1", {}),
    ("reward_kl_without_reinforce", run("grpo", "grpo.reward_kl_coef=0.1"), "grpo: reward_kl_coef=0.1 is the KL penalty in the rewards of the reinforce_plus_plus estimators, and advantage_estimator=grpo does not use it", {}),
    ("reward_kl_and_loss_kl", run("grpo", "grpo.advantage_estimator=reinforce_plus_plus", "grpo.reward_kl_coef=0.1", "loss.clipped_pg.kl_coef=0.01"), "grpo.reward_kl_coef=0.1 and loss.clipped_pg.kl_coef=0.01 both penalise the KL to the reference", {}),
    ("cispo_clip_high_negative", run("grpo", "loss.clipped_pg.use_cispo=true", "loss.clipped_pg.clip_eps_high=-0.5"), "loss.clipped_pg.clip_eps_high must be >= 0, got -0.5", {}),
    # issue 49, h-ppo
    ("ppo_value_clip_negative", run("ppo", "ppo.value_clip=-1"), "ppo.value_clip must be >= 0 or null, got -1", {}),
    ("ppo_lam_above_1", run("ppo", "ppo.lam=2"), "ppo.lam must be in [0, 1], got 2", {}),
    ("ppo_gamma_negative", run("ppo", "ppo.gamma=-0.5"), "ppo.gamma must be in [0, 1], got -0.5", {}),
    ("ppo_epochs_zero", run("ppo", "ppo.ppo_epochs=0"), "ppo.ppo_epochs must be in [1, 64], got 0", {}),
    ("ppo_whiten_not_bool", run("ppo", "ppo.whiten_advantages=maybe"), "ppo.whiten_advantages: expected bool, got str 'maybe'", {}),
    ("ppo_critic_warmup_negative", run("ppo", "ppo.critic_warmup_steps=-1"), "ppo.critic_warmup_steps must be >= 0, got -1", {}),
    ("ppo_estimator_not_gae", run("ppo", "ppo.advantage_estimator=grpo"), "ppo.advantage_estimator must be one of gae, got 'grpo'", {}),
    ("ppo_no_generations", run("ppo", "ppo.num_generations_per_prompt=0"), "ppo.num_generations_per_prompt must be >= 1, got 0", {}),
    ("ppo_reward_kl_negative", run("ppo", "ppo.reward_kl_coef=-1"), "ppo.reward_kl_coef must be >= 0, got -1", {}),
    ("ppo_reward_kl_and_loss_kl", run("ppo", "ppo.reward_kl_coef=0.1", "loss.clipped_pg.kl_coef=0.01"), "ppo.reward_kl_coef=0.1 and loss.clipped_pg.kl_coef=0.01 both penalise the KL to the reference", {}),
    ("ppo_async", run("ppo", "ppo.async.enabled=true"), "ppo.async.enabled=true: asynchronous PPO is not supported yet", {}),
    ("critic_no_workers", run("ppo", "critic.num_workers=0"), "critic.num_workers must be >= 1, got 0", {}),
    ("critic_backend_unknown", run("ppo", "critic.backend=nope"), "no policy named 'nope' is registered (critic.backend=nope)", {}),
    ("critic_head_lm", run("ppo", "critic.dtensor.head=lm"), "critic.dtensor.head=lm: the critic needs a value head; set critic.dtensor.head=auto (or scalar)", {}),
    ("ppo_policy_head_scalar", run("ppo", "policy.dtensor.head=scalar"), "policy.dtensor.head=scalar: the PPO policy generates, so it needs its LM head", {}),
    ("critic_micro_batch_too_large", run("ppo", "critic.train_micro_batch_size=512"), "critic.train_micro_batch_size=512 is larger than critic.train_global_batch_size=64", {}),
    ("critic_batch_uneven", run("ppo", "critic.num_workers=3"), "critic.train_global_batch_size=64 does not split evenly over the 3 data-parallel ranks", {}),
    ("ppo_group_baseline_switch", run("ppo", "ppo.use_leave_one_out_baseline=false"), "ppo: use_leave_one_out_baseline=False shapes GRPO's group baseline, and PPO's baseline is the critic", {}),
    ("critic_lr_negative", run("ppo", "critic.optimizer.lr=-1"), "critic.optimizer.lr must be > 0, got -1", {}),
    # issue 52, h-replay
    ("router_replay_dense_model", run("grpo", "policy.moe.router_replay=true"), "policy.moe.router_replay=true needs a mixture-of-experts model, and policy.model_name=tiny has no experts", {}),
    ("record_routing_dense_folder", run("grpo", "policy.model_name={d}/dense_model", "policy.moe.record_routing=true"), "policy.moe.record_routing=true needs a mixture-of-experts model, and policy.model_name={d}/dense_model has no experts", {}),
    ("router_replay_megatron", run("grpo", "policy.model_name=tiny-moe", "policy.backend=megatron", "policy.moe.router_replay=true"), "policy.moe.router_replay=true, and policy.backend=megatron cannot replay or compare the engine's routing", {}),
    ("router_replay_sglang", run("grpo", "policy.model_name=tiny-moe", SGLANG, "policy.moe.router_replay=true"), "policy.moe.router_replay=true, and generation.backend=sglang does not record which experts it routes each token to", {}),
    ("router_replay_not_bool", run("grpo", "policy.moe.router_replay=maybe"), "policy.moe.router_replay: expected bool, got str 'maybe'", {}),
    ("router_replay_unknown_router", run("grpo", "policy.model_name=tiny-gpt_oss", "policy.moe.router_replay=true"), "policy.moe.router_replay=true, and policy.backend=dtensor replays the routers of qwen3_moe, qwen3_5_moe models only (policy.model_name=tiny-gpt_oss is gpt_oss)", {}),
    # issue 52, h-lora
    ("lora_refit_unknown", run("grpo", "generation.lora_refit=deltas"), "generation.lora_refit must be one of auto, adapters, merged, got 'deltas'", {}),
    ("lora_refit_adapters_sglang", run("grpo", SGLANG, "policy.dtensor.lora_rank=8", "generation.lora_refit=adapters"), "generation.lora_refit=adapters: the sglang engine cannot take adapter-only LoRA refits; set generation.lora_refit=merged (or auto)", {}),
    # issue 52, h-meglora
    ("megatron_lora_rank", run("grpo", "policy.backend=megatron", "policy.megatron.lora_rank=-1"), "policy.megatron.lora_rank must be in [0, 65536], got -1", {}),
    ("megatron_lora_alpha", run("grpo", "policy.backend=megatron", "policy.megatron.lora_alpha=0"), "policy.megatron.lora_alpha must be > 0, got 0", {}),
    ("megatron_lora_dropout", run("sft", "policy.backend=megatron", "policy.megatron.lora_dropout=1"), "policy.megatron.lora_dropout must be in [0, 1), got 1", {}),
    ("megatron_lora_unknown_target", run("grpo", "policy.backend=megatron", "policy.megatron.lora_rank=8", "policy.megatron.lora_target_modules=[q_proj,lm_head]"), "policy.megatron: lora_target_modules='lm_head' is not a projection of a Megatron decoder layer; use some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or all-linear", {}),
    ("megatron_lora_transformer_engine", run("grpo", "policy.backend=megatron", "policy.megatron.lora_rank=8", "policy.megatron.transformer_engine=true"), "policy.megatron: LoRA (lora_rank > 0) runs on the local layer spec only", {}),
    # issue 52, h-dtlora
    ("convert_lora_adapters_without_lora", ["convert", "{d}/ckpt_no_lora/step_2", "{d}/converted", "--lora", "adapters"], "--lora adapters: {d}/ckpt_no_lora/step_2 is a policy without LoRA (policy.dtensor.lora_rank is 0), so it has no adapters to export; drop --lora", {}),
    ("convert_lora_unknown", ["convert", "{d}/ckpt_no_lora/step_2", "{d}/converted", "--lora", "deltas"], "--lora: invalid choice: 'deltas'", {}),
    # issue 51, h-partial
    ("async_over_age_unknown", run("grpo", "grpo.async.over_age=discard"), "grpo.async.over_age must be one of mask, train, drop, got 'discard'", {}),
    ("async_tokens_per_call_negative", run("grpo", "grpo.async.max_tokens_per_call=-1"), "grpo.async.max_tokens_per_call must be >= 0, got -1", {}),
    ("async_partial_with_dynamic_sampling", run("grpo", "grpo.async.max_tokens_per_call=4", "grpo.dynamic_sampling=true"), "grpo.async.max_tokens_per_call continues samples across the calls of the streaming producer, and grpo.dynamic_sampling produces whole-step batches", {}),
    # issue 51, h-inflight
    # issue 51, h-replace
    ("replace_dead_engines_without_async", run("grpo", "grpo.async.replace_dead_engines=true"), "grpo.async.replace_dead_engines=true needs grpo.async.enabled=true", {}),
    ("in_flight_without_async", run("grpo", "grpo.async.in_flight_weight_updates=true"), "grpo.async.in_flight_weight_updates=true needs grpo.async.enabled=true", {}),
    ("in_flight_colocated_torch", run("grpo", "grpo.async.enabled=true", "grpo.async.in_flight_weight_updates=true"), "grpo.async.in_flight_weight_updates=true: the torch engines cannot take a refit while a call is in flight; set generation.torch.colocated=false (separate engines), or set grpo.async.in_flight_weight_updates=false", {}),
    ("in_flight_vllm_sync_engine", run("grpo", VLLM, "generation.vllm.colocated=false", "grpo.async.enabled=true", "grpo.async.in_flight_weight_updates=true"), "grpo.async.in_flight_weight_updates=true: the vllm engines cannot take a refit while a call is in flight; set generation.vllm.async_engine=true", {}),
    ("in_flight_sglang", run("grpo", SGLANG, "generation.sglang.colocated=false", "grpo.async.enabled=true", "grpo.async.in_flight_weight_updates=true"), "grpo.async.in_flight_weight_updates=true: the sglang engines cannot take a refit while a call is in flight; choose an engine that takes in-flight refits", {}),
]  # fmt: skip

SUBPROCESS_CASES = [
    "lr_negative",
    "config_binary",
    "policy_backend",
    "model_missing",
    "actor_env_not_python",
    "plot_garbage_line",
    "algorithm_unknown",
    "config_alias_bomb",
]


def _argv(case_argv, d, runs):
    argv = [a.replace("{d}", str(d)) for a in case_argv]
    if argv[0] in ("run", "eval") and "--config" not in argv:
        head = 2 if argv[0] == "run" else 1
        safe = [f"logger.log_dir={runs}", "checkpointing.enabled=false"]
        argv = argv[:head] + safe + argv[head:]
    return argv


def _assert_one_line(rc, out, err, expected, elapsed):
    assert rc == 2, f"exit code {rc}; stderr: {err[-1500:]}"
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"stderr is not one line:\n{err[-3000:]}"
    assert lines[0].startswith("error: ") and lines[0][len("error: ") :].strip()
    assert expected in lines[0], lines[0]
    assert elapsed < CASE_BUDGET_S, f"took {elapsed:.1f}s"


@pytest.fixture(scope="module")
def warm():
    """Import what the algorithms import, once: the 10 s budget of a case is for its checks,
    not for the first import of torch and transformers (which every `nrl run` pays anyway)."""
    from transformers import AutoTokenizer

    import nrl_core.algorithms.dpo
    import nrl_core.algorithms.evaluate
    import nrl_core.algorithms.grpo
    import nrl_core.algorithms.rm
    import nrl_core.algorithms.sft  # noqa: F401
    from nrl_core.testing.tiny import tiny_model_path

    AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture
def ray_tripwire(monkeypatch):
    """Fail the case the moment anything would start Ray; report whether Ray ran before."""
    import ray

    def tripped(*args, **kwargs):
        raise RayStarted("a bad input got past every check: ray.init was called")

    was_initialized = ray.is_initialized()
    monkeypatch.setattr(ray, "init", tripped)
    yield
    if not was_initialized:
        assert not ray.is_initialized()


def test_the_table_is_large_and_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
    assert set(SUBPROCESS_CASES) <= set(ids)


@pytest.mark.parametrize(
    ("argv", "expected", "env"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_line_exit_2(argv, expected, env, d, warm, ray_tripwire, capsys, monkeypatch, tmp_path):  # fmt: skip
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    argv = _argv(argv, d, tmp_path / "runs")
    capsys.readouterr()
    started = time.perf_counter()
    rc = main(argv)
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    _assert_one_line(rc, out, err, expected.replace("{d}", str(d)), elapsed)
    assert not (tmp_path / "runs").exists(), "a refused run must leave no run folder"


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_through_the_entry_point(case_id, d, tmp_path):
    _, argv, expected, env = next(c for c in CASES if c[0] == case_id)
    environ = {k: v for k, v in os.environ.items() if env.get(k, "") is not None}
    environ.update({k: v for k, v in env.items() if v is not None})
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", *_argv(argv, d, tmp_path / "runs")],
        capture_output=True, text=True, env=environ, timeout=120,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    _assert_one_line(
        result.returncode, result.stdout, result.stderr, expected.replace("{d}", str(d)), elapsed
    )
    assert not (tmp_path / "runs").exists(), "a refused run must leave no run folder"
