"""The driver-side checks that run before anything starts (nrl_core.preflight): each problem is
one ConfigError line naming the key and the fix, and the whole of preflight takes seconds."""

from __future__ import annotations

import json
import shutil
import sys
import time
import uuid

import attrs
import pytest

from nrl_core import hookimpl
from nrl_core.algorithms.recipes import default_recipe
from nrl_core.config.loader import ConfigConverter, resolve_config
from nrl_core.config.schema import EvalConfig, option
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginHost
from nrl_core.preflight import check_model_source, check_writable_folder, preflight
from nrl_core.testing.tiny import tiny_model_path

PREFLIGHT_BUDGET_S = 5.0


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


@pytest.fixture(scope="module")
def tiny():
    """The cached tiny model folder (the one ``policy.model_name=tiny`` resolves to)."""
    return tiny_model_path()


def config_of(algorithm, overrides, registry, tmp_path):
    safe = [f"logger.log_dir={tmp_path / 'runs'}", "checkpointing.enabled=false"]
    if algorithm == "eval":
        from nrl_core.config.loader import apply_overrides

        data = apply_overrides(default_recipe("eval"), [*safe, *overrides])
        return ConfigConverter(registry).structure(data, EvalConfig)
    return resolve_config(
        algorithm, None, [*safe, *overrides], registry, defaults=default_recipe(algorithm)
    )


def refused(config, registry) -> str:
    with pytest.raises(ConfigError) as error:
        preflight(config, registry)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("algorithm", ["grpo", "sft", "dpo", "rm", "eval"])
def test_the_embedded_recipes_pass_in_well_under_the_budget(algorithm, registry, tmp_path, tiny):
    # The tiny model by name and by folder (a real Hugging Face folder: config, weights,
    # tokenizer files, all parsed).
    for model in ("tiny", str(tiny)):
        config = config_of(algorithm, [f"policy.model_name={model}"], registry, tmp_path)
        started = time.perf_counter()
        preflight(config, registry)
        elapsed = time.perf_counter() - started
        print(f"preflight {algorithm} model={model}: {elapsed * 1000:.0f} ms")
        assert elapsed < PREFLIGHT_BUDGET_S
    assert not (tmp_path / "runs").exists(), "preflight must not create the run folder"


def _copy_model(tiny, dest, drop=()):
    shutil.copytree(tiny, dest)
    for name in drop:
        for path in dest.glob(name):
            path.unlink()
    return dest


def test_model_folders_are_checked_for_what_loading_needs(tmp_path, tiny):
    def message(name, **kwargs):
        with pytest.raises(ConfigError) as error:
            check_model_source(str(name), "policy.model_name", weights=True, tokenizer=True)
        return str(error.value)

    assert "no such folder" in message(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in message(tmp_path / "empty")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer_state.json").write_text('{"step": 3}')
    assert "nrl convert" in message(tmp_path / "ckpt")
    (tmp_path / "file").write_text("x")
    assert "is a file" in message(tmp_path / "file")
    no_weights = _copy_model(tiny, tmp_path / "no-weights", ["*.safetensors", "*.bin"])
    assert "has no weights" in message(no_weights)
    no_tokenizer = _copy_model(tiny, tmp_path / "no-tok", ["tokenizer*", "vocab*", "special*"])
    assert "has no tokenizer files" in message(no_tokenizer)
    assert "policy.tokenizer_name" in message(no_tokenizer)
    broken = _copy_model(tiny, tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "llama", ')
    assert "config.json is not valid JSON" in message(broken)
    # The intact folder passes, and a tokenizer-only check does not ask for weights.
    check_model_source(str(tiny), "policy.model_name", weights=True, tokenizer=True)
    check_model_source(str(no_weights), "policy.tokenizer_name", weights=False, tokenizer=True)


def test_a_hub_name_offline_is_refused_at_once(monkeypatch):
    name = f"nrl-tests/no-such-model-{uuid.uuid4().hex[:8]}"  # never in the local cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        check_model_source(name, "policy.model_name", weights=True, tokenizer=True)
    assert time.perf_counter() - started < 1.0
    assert str(error.value).startswith(f"policy.model_name={name} is not a local folder")
    assert "HF_HUB_OFFLINE" in str(error.value) and "hf download" in str(error.value)


def test_an_unreachable_hub_is_said_fast(monkeypatch):
    # Port 9 (discard) on the loopback is closed: the hub "cannot be reached", without retries.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    name = f"nrl-tests/no-such-model-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        check_model_source(name, "policy.model_name", weights=True, tokenizer=True)
    elapsed = time.perf_counter() - started
    print(f"unreachable hub refused in {elapsed * 1000:.0f} ms")
    assert elapsed < PREFLIGHT_BUDGET_S
    assert "the hub cannot be reached" in str(error.value)
    assert "\n" not in str(error.value)


def test_lora_puts_peft_into_the_policy_venv(registry, tmp_path, monkeypatch):
    """The dtensor venv gets the `lora` extra when lora_rank > 0 (and only then); running the
    policy in an interpreter that has peft works too."""
    from nrl_core.distributed.actor_env import component_extras

    monkeypatch.delenv("NRL_ACTOR_ENV", raising=False)
    monkeypatch.delenv("NRL_ACTOR_VENV_LAYER", raising=False)
    spec = registry.get("policy", "dtensor")
    for lora_rank, extras in ((8, ("lora",)), (0, ())):
        config = config_of("sft", [f"policy.dtensor.lora_rank={lora_rank}"], registry, tmp_path)
        preflight(config, registry)
        assert component_extras(spec, config.policy.options_for()) == extras
    # The driver's interpreter has peft (a dev dependency): running the policy there works,
    # and so does naming that interpreter (asked for real, in a subprocess).
    for actor_env in ("system", sys.executable):
        preflight(
            config_of(
                "sft", ["policy.dtensor.lora_rank=8", f"policy.actor_env={actor_env}"], registry,
                tmp_path,
            ),
            registry,
        )  # fmt: skip


def test_adapter_refits_put_peft_into_the_torch_engines_venv(registry, tmp_path):
    """Issue 52: separate torch engines refitted with LoRA adapters apply them through peft,
    so their venv gets nrl-dtensor's `lora` extra; vLLM's does not need it (its own LoRA
    support), and neither do merged refits, nor runs without LoRA. `auto` picks adapters
    for torch and vLLM, merged for SGLang."""
    from nrl_core.distributed.actor_env import _lora_adapter_extras
    from nrl_core.weight_sync.adapters import lora_refit_mode

    separate = "generation.torch.colocated=false"
    cases = [
        ([separate, "policy.dtensor.lora_rank=8"], "adapters", ("lora",)),
        ([separate, "policy.dtensor.lora_rank=8", "generation.lora_refit=merged"], "merged", ()),
        ([separate], None, ()),
        (["generation.backend=vllm", "policy.dtensor.lora_rank=8"], "adapters", ()),
        (["generation.backend=sglang", "policy.dtensor.lora_rank=8"], "merged", ()),
    ]
    for overrides, mode, extras in cases:
        config = config_of("grpo", overrides, registry, tmp_path)
        assert lora_refit_mode(config) == mode, overrides
        assert _lora_adapter_extras(config, config.generation.options_for()) == extras, overrides


@attrs.define
class NeedsModule:
    """Options of a test environment that needs a module nobody has, through extra `fancy`."""

    fancy: bool = option(False, "Use the absent module.")

    def required_modules(self):
        return {"nrl_tests_absent_module": ("fancy", "fancy=true")} if self.fancy else {}


def _host_with_needy_env(extras):
    class Plugin:
        @hookimpl
        def nrl_register_environments(self, register):
            register("needy", "x:y", config=NeedsModule, extras=extras)

    host = PluginHost.discover()
    host.add(Plugin(), "needy-plugin", distribution="nrl-needy")
    return host.registry()


@pytest.mark.parametrize(
    ("extras", "actor_env", "expected"),
    [
        ((), None, None),  # its venv is built with the extra the options require
        ((), "system", "which this interpreter (where the environment runs: actor_env=system)"),
        ((), sys.executable, f"which the environment's actor_env={sys.executable} cannot import"),
        (("fancy",), None, None),  # a registered extra: the same
    ],
)
def test_required_modules_of_any_component(extras, actor_env, expected, tmp_path, monkeypatch):
    monkeypatch.delenv("NRL_ACTOR_ENV", raising=False)
    registry = _host_with_needy_env(list(extras))
    overrides = ["env.name=needy", "env.needy.fancy=true"]
    if actor_env:
        overrides.append(f"env.actor_env={actor_env}")
    config = config_of("grpo", overrides, registry, tmp_path)
    if expected is None:
        preflight(config, registry)
        return
    message = refused(config, registry)
    assert message.startswith("env.needy.fancy=true needs `nrl_tests_absent_module`")
    assert expected in message
    assert "nrl-needy[fancy]" in message


def test_output_folders_must_be_writable(registry, tmp_path):
    (tmp_path / "a-file").write_text("x")
    message = refused(
        config_of("grpo", [f"logger.log_dir={tmp_path / 'a-file' / 'runs'}"], registry, tmp_path),
        registry,
    )
    assert message.startswith(f"logger.log_dir={tmp_path / 'a-file' / 'runs'}: ")
    assert "is a file, not a folder" in message
    # /proc takes no new folders, even for root (for whom os.access always says yes).
    with pytest.raises(ConfigError, match=r"checkpointing\.checkpoint_dir=/proc/nrl-x: cannot"):
        check_writable_folder("/proc/nrl-x", "checkpointing.checkpoint_dir")
    (tmp_path / "out").mkdir()
    message = refused(
        config_of("eval", [f"eval.output={tmp_path / 'out'}"], registry, tmp_path), registry
    )
    assert message.startswith("eval.output=") and "is a folder" in message
    # A folder that does not exist yet but can be created passes, and is not created.
    check_writable_folder(tmp_path / "new" / "deeper", "logger.log_dir")
    assert not (tmp_path / "new").exists()


def test_resume_path_and_named_files_must_exist(registry, tmp_path):
    message = refused(
        config_of(
            "grpo",
            ["checkpointing.enabled=true", f"checkpointing.resume={tmp_path / 'step_9'}"],
            registry,
            tmp_path,
        ),
        registry,
    )
    assert message.startswith(f"checkpointing.resume={tmp_path / 'step_9'}: no such folder")
    missing = tmp_path / "train.jsonl"
    message = refused(config_of("grpo", [f"data.dataset={missing}"], registry, tmp_path), registry)
    assert message == f"data.dataset={missing} does not exist; check the path"
    missing.write_text("")
    message = refused(config_of("grpo", [f"data.dataset={missing}"], registry, tmp_path), registry)
    assert "is empty" in message
    message = refused(
        config_of("sft", [f"data.chat.validation_path={tmp_path / 'v.jsonl'}"], registry, tmp_path),
        registry,
    )
    assert message.startswith("data.chat.validation_path=")


def test_cross_section_checks_also_cover_configs_changed_in_code(registry, tmp_path):
    config = config_of("grpo", [], registry, tmp_path)
    # Each field is valid on its own (attrs.evolve ran the validators); together they are not.
    config = attrs.evolve(config, generation=attrs.evolve(config.generation, max_new_tokens=48))
    message = refused(config, registry)
    assert message.startswith("generation.max_new_tokens=48 leaves no room for a prompt")


def test_a_tokenizer_config_that_is_not_an_object_is_refused(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        check_model_source(str(folder), "policy.tokenizer_name", weights=False, tokenizer=True)


def test_an_actor_env_must_be_an_interpreter(registry, tmp_path, monkeypatch):
    monkeypatch.delenv("NRL_ACTOR_ENV", raising=False)
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")  # not executable
    message = refused(config_of("grpo", [f"env.actor_env={script}"], registry, tmp_path), registry)
    assert message.startswith(f"env.actor_env={script} is not an executable Python interpreter")
    monkeypatch.setenv("NRL_ACTOR_ENV", str(tmp_path / "none"))
    message = refused(config_of("grpo", [], registry, tmp_path), registry)
    assert message.startswith(f"$NRL_ACTOR_ENV={tmp_path / 'none'} is not an executable")
    monkeypatch.setenv("NRL_ACTOR_ENV", sys.executable)
    preflight(config_of("grpo", [], registry, tmp_path), registry)
