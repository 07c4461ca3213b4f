"""The memory plan (nrl_core.memory_plan) and its preflight check (issue 46, GPU review 3 M4).

The shapes are the published ``config.json`` files of Qwen3-30B-A3B and Qwen2.5-7B
(tests/fixtures/model_shapes/README.md). Expected figures come from outside the code: the
parameter counts of the model cards and the per-GPU table of GPU review 3, M4.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.algorithms.recipes import default_recipe
from nrl_core.cli import main
from nrl_core.config.loader import resolve_config
from nrl_core.errors import ConfigError
from nrl_core.memory_plan import GIB, ModelShape, plan_memory
from nrl_core.plugins import PluginHost
from nrl_core.preflight import check_memory_plan

SHAPES = Path(__file__).parent / "fixtures" / "model_shapes"
H100 = 79.6 * GIB  # nvidia-smi's 81559 MiB
QWEN3_MOE = ModelShape.from_folder(SHAPES / "qwen3-30b-a3b")
QWEN25_7B = ModelShape.from_folder(SHAPES / "qwen2.5-7b")


def megatron_layout(**options):
    from nrl_megatron.config import MegatronConfig

    return MegatronConfig(**options).memory_layout(num_ranks=8, precision="bfloat16")


# -- the arithmetic --------------------------------------------------------------------------


def test_parameter_counts_match_the_model_cards():
    # Model cards: Qwen3-30B-A3B "30.5B in total" (3.3B activated), Qwen2.5-7B "7.61B".
    assert QWEN3_MOE.total_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert QWEN25_7B.total_params / 1e9 == pytest.approx(7.61, abs=0.02)
    # 3.3B activated: the dense part plus 8 of the 128 experts of each layer.
    active = QWEN3_MOE.non_expert_params + QWEN3_MOE.expert_params * 8 / 128
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)  # the card rounds


def test_review_m4_table_for_qwen3_moe_at_ep8_dp8():
    # GPU review 3, M4: bf16 params 9.6 GiB, fp32 grads 19.3 GiB, dense optimizer 2.2 GiB,
    # expert optimizer 40.5 GiB (expert-DP 1): about 72 GiB of 79.6, before activations.
    layout = megatron_layout(expert_model_parallel_size=8)
    assert (layout.dp, layout.expert_dp) == (8, 1)
    plan = plan_memory(QWEN3_MOE, layout, device_bytes=H100)
    gib = {item.name: item.nbytes / GIB for item in plan.items}
    assert gib["params"] == pytest.approx(9.6, rel=0.03)
    assert gib["grads"] == pytest.approx(19.3, rel=0.03)
    assert gib["optimizer"] == pytest.approx(2.2 + 40.5, rel=0.03)
    assert gib["logits"] == 0
    assert plan.total / GIB == pytest.approx(72, rel=0.03)
    assert plan.fits
    # The default bin (4 x 512 tokens) takes it above 90%: accepted with a warning.
    small = plan_memory(QWEN3_MOE, layout, device_bytes=H100, micro_batch_tokens=2048)
    assert small.fits and small.tight
    assert "above 90%" in small.warning() and "\n" not in small.warning()


def test_a_16k_token_bin_tips_it_over_and_the_refusal_names_the_knobs():
    # The review: "the fp32 logits of one 16k-token bin are 9.3 GiB on top of that".
    layout = megatron_layout(expert_model_parallel_size=8)
    plan = plan_memory(QWEN3_MOE, layout, device_bytes=H100, micro_batch_tokens=16384)
    assert plan.item("logits").nbytes / GIB == pytest.approx(9.3, rel=0.01)
    assert not plan.fits
    line = plan.refusal("policy.megatron on 8 GPUs")
    assert "\n" not in line and "of 79.6 GiB per GPU" in line
    assert "policy.megatron.grad_reduce_in_fp32=false" in line
    assert "policy.megatron.optimizer_cpu_offload=true" in line
    assert "at expert-DP 1" in line


def test_bf16_grads_and_optimizer_offload_fit():
    layout = megatron_layout(
        expert_model_parallel_size=8, grad_reduce_in_fp32=False, optimizer_cpu_offload=True
    )
    plan = plan_memory(QWEN3_MOE, layout, device_bytes=H100, micro_batch_tokens=16384)
    # Only the fp32 main weights (4 of the 12 bytes per parameter) stay on the GPU.
    full = plan_memory(QWEN3_MOE, megatron_layout(expert_model_parallel_size=8), device_bytes=H100)
    assert plan.item("optimizer").nbytes == pytest.approx(full.item("optimizer").nbytes / 3)
    assert plan.item("grads").nbytes == pytest.approx(full.item("grads").nbytes / 2)
    assert plan.fits and not plan.tight
    assert plan.summary().startswith("memory plan (megatron): ")


def test_parallelism_divides_what_it_should():
    base = plan_memory(QWEN25_7B, megatron_layout(), device_bytes=H100)
    tp2 = plan_memory(QWEN25_7B, megatron_layout(tensor_model_parallel_size=2), device_bytes=H100)
    pp2 = plan_memory(QWEN25_7B, megatron_layout(pipeline_model_parallel_size=2), device_bytes=H100)
    assert tp2.item("params").nbytes == pytest.approx(base.item("params").nbytes / 2)
    # The optimizer shards over DP, which TP halves: the same bytes per GPU.
    assert tp2.item("optimizer").nbytes == pytest.approx(base.item("optimizer").nbytes)
    # A stage holds half the layers and one end of the vocabulary.
    assert base.item("params").nbytes / 2 < pp2.item("params").nbytes
    assert pp2.item("params").nbytes < base.item("params").nbytes * 0.6


def test_dtensor_fsdp_shards_everything_over_the_ranks():
    from nrl_dtensor.config import DTensorConfig

    def plan(ranks, **options):
        layout = DTensorConfig(**options).memory_layout(num_ranks=ranks, precision="bfloat16")
        return plan_memory(QWEN25_7B, layout, device_bytes=H100)

    one, eight = plan(1), plan(8)
    # fp32 master weights, fp32 grads, two fp32 moments: 16 bytes per parameter, / 8 ranks.
    state = sum(eight.item(n).nbytes for n in ("params", "grads", "optimizer"))
    assert state == pytest.approx(QWEN25_7B.total_params * 16 / 8)
    assert not one.fits and eight.fits  # 7.6B x 16 bytes = 113 GiB on one GPU
    assert plan(8, fsdp_units="model").item("gathered").nbytes > eight.item("gathered").nbytes
    offload = plan(8, cpu_offload=True)
    assert offload.item("params").nbytes == offload.item("optimizer").nbytes == 0


# -- the preflight check ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A model folder preflight accepts: the real config.json, placeholder weights and
    tokenizer files (the plan reads config.json only)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("qwen3-30b-a3b")
    shutil.copy(SHAPES / "qwen3-30b-a3b" / "config.json", folder / "config.json")
    # A valid safetensors file holding no tensor: preflight reads the header (issue 47).
    save_file({}, folder / "model.safetensors")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


REFUSED = [
    "policy.backend=megatron",
    "policy.precision=bfloat16",
    "policy.num_workers=8",
    "policy.megatron.expert_model_parallel_size=8",
    "policy.max_total_sequence_length=4096",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=4",
    "generation.backend=vllm",
    "generation.vllm.colocated=false",
    "cluster.gpu_memory_gib=79.6",
]
FITS = ["policy.megatron.grad_reduce_in_fp32=false", "policy.megatron.optimizer_cpu_offload=true"]


def config_of(overrides, registry, tmp_path):
    safe = [f"logger.log_dir={tmp_path / 'runs'}", "checkpointing.enabled=false"]
    return resolve_config(
        "grpo", None, [*safe, *overrides], registry, defaults=default_recipe("grpo")
    )


def test_a_colocated_engine_is_checked_at_refit_and_in_its_share(registry, qwen3_folder, tmp_path):
    # GPU review 3, M4: a single-GPU vLLM engine needs 57 GiB of bf16 weights, more than
    # gpu_memory_utilization=0.6 x 80 GB: colocation is impossible for this model.
    overrides = [f"policy.model_name={qwen3_folder}", *REFUSED[:-3], *FITS]
    big = ["cluster.gpu_memory_gib=139.8", "generation.backend=vllm"]  # an H200
    separate = config_of([*overrides, *big, "generation.vllm.colocated=false"], registry, tmp_path)
    assert "colocated engine" not in check_memory_plan(separate, registry)
    with pytest.raises(ConfigError) as error:  # 57 GiB of weights, 0.6 x 79.6 = 47.8 GiB
        check_memory_plan(config_of([*overrides, *REFUSED[-3:-2], "cluster.gpu_memory_gib=79.6"], registry, tmp_path), registry)  # fmt: skip
    assert "the colocated engine's weights (56.9 GiB) exceed its share of the GPU (47.8" in str(
        error.value
    )
    assert "generation.vllm.colocated=false" in str(error.value)
    # On an H200 with a 0.7 share the weights fit the engine's share (97.9 GiB) and, at a
    # refit, beside the policy's weights and bf16 gradients (9.6 + 9.6 + 56.9 < 139.8 GiB) ...
    roomy = config_of([*overrides, *big, "generation.vllm.gpu_memory_utilization=0.7"], registry, tmp_path)  # fmt: skip
    line = check_memory_plan(roomy, registry)
    assert "colocated engine: weights 56.9 of its 97.9 GiB, refit peak 76.1 GiB" in line
    # ... while fp32 grads beside them on 80 GiB do not (9.6 + 19.3 + 56.9 GiB), though the
    # training phase fits with the optimizer offloaded.
    with pytest.raises(ConfigError) as error:
        check_memory_plan(config_of([*REFUSED[:-3], f"policy.model_name={qwen3_folder}", FITS[1], "generation.backend=vllm", "generation.vllm.gpu_memory_utilization=0.95", "cluster.gpu_memory_gib=79.6"], registry, tmp_path), registry)  # fmt: skip
    assert "at each refit" in str(error.value)
    assert "policy.megatron.grad_reduce_in_fp32=false" in str(error.value)


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="this machine has a GPU: it is measured"
)
def test_no_gpu_and_no_setting_means_no_plan(registry, qwen3_folder, tmp_path):
    config = config_of([f"policy.model_name={qwen3_folder}", *REFUSED[:-1]], registry, tmp_path)
    assert check_memory_plan(config, registry) is None
    why = check_memory_plan(config, registry, verbose=True)
    assert why == "memory plan: skipped (no GPU seen here and cluster.gpu_memory_gib unset)"


def test_the_cli_refuses_in_one_line_before_ray(qwen3_folder, tmp_path):
    argv = ["run", "grpo", f"policy.model_name={qwen3_folder}", *REFUSED]
    argv += [f"logger.log_dir={tmp_path / 'runs'}"]
    result = subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", *argv],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: policy.megatron on 8 GPUs:")
    assert "policy.megatron.grad_reduce_in_fp32=false" in lines[0]
    assert not (tmp_path / "runs").exists()


class Started(BaseException):
    """The algorithm was entered: everything before it (preflight) passed."""


def test_the_cli_shows_the_accepted_plan_before_the_run(
    qwen3_folder, tmp_path, capsys, monkeypatch
):
    import nrl_core.algorithms.grpo as grpo

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(grpo, "run", started)
    argv = ["run", "grpo", f"policy.model_name={qwen3_folder}", *REFUSED, *FITS]
    with pytest.raises(Started):
        main([*argv, f"logger.log_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memory plan (megatron): ")
    assert " of 79.6 GiB per GPU (" in err[0]
