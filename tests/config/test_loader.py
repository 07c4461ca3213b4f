"""Config files, ``defaults:`` inheritance, overrides and error messages (nrl_core.config)."""

from __future__ import annotations

import textwrap

import attrs
import pytest

from nrl_core import hookimpl
from nrl_core.algorithms.recipes import default_recipe
from nrl_core.config.loader import ConfigConverter, dump_config, parse_yaml, resolve_config
from nrl_core.config.schema import ALGORITHM_CONFIGS, option
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginHost
from nrl_core.registry import Registry


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


def test_defaults_chain_later_files_win_and_the_file_itself_wins_last(tmp_path, registry):
    write(
        tmp_path / "base.yaml",
        """
        seed: 1
        policy: {optimizer: {lr: 1.0e-3, warmup_steps: 5}, train_micro_batch_size: 2}
        grpo: {max_num_steps: 10}
    """,
    )
    (tmp_path / "sub").mkdir()
    write(
        tmp_path / "sub" / "mid.yaml",
        """
        defaults: ../base.yaml
        policy: {optimizer: {lr: 2.0e-3}}
        grpo: {max_num_steps: 20, num_prompts_per_step: 3}
    """,
    )
    write(tmp_path / "other.yaml", "grpo: {num_prompts_per_step: 4}\nseed: 2\n")
    run = write(
        tmp_path / "run.yaml",
        """
        defaults: [sub/mid.yaml, other.yaml]
        grpo: {max_num_steps: 30}
    """,
    )
    config = resolve_config("grpo", run, registry=registry)
    assert config.seed == 2  # other.yaml beats mid/base
    assert config.policy.optimizer.lr == 2.0e-3  # mid beats base
    assert config.policy.optimizer.warmup_steps == 5  # base survives the merge
    assert config.policy.train_micro_batch_size == 2
    assert config.grpo.num_prompts_per_step == 4  # later default wins
    assert config.grpo.max_num_steps == 30  # the file itself wins last


def test_defaults_cycle_is_an_error(tmp_path, registry):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        resolve_config("grpo", tmp_path / "a.yaml", registry=registry)


def test_overrides_are_parsed_as_yaml_scalars(registry):
    config = resolve_config(
        "grpo",
        None,
        [
            "policy.optimizer.lr=1e-5",
            "grpo.max_num_steps=7",
            "data.shuffle=false",
            'generation.stop_strings=["\\n", "END"]',
            "policy.tokenizer_name=null",
            "logger.run_name=exp-1",
        ],
        registry,
    )
    assert config.policy.optimizer.lr == 1e-5
    assert config.grpo.max_num_steps == 7
    assert config.data.shuffle is False
    assert config.generation.stop_strings == ["\n", "END"]
    assert config.policy.tokenizer_name is None
    assert config.logger.run_name == "exp-1"


def test_overrides_beat_the_file_which_beats_the_recipe(tmp_path, registry):
    run = write(tmp_path / "run.yaml", "seed: 5\ngrpo: {max_num_steps: 3}\n")
    config = resolve_config(
        "grpo",
        run,
        ["seed=9"],
        registry,
        defaults={"seed": 1, "grpo": {"val_period": 2, "max_num_steps": 1}},
    )
    assert (config.seed, config.grpo.max_num_steps, config.grpo.val_period) == (9, 3, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policy.optimzer.lr=1"], "unknown key policy.optimzer; did you mean policy.optimizer?"),
        (
            ["grpo.max_num_step=1"],
            "unknown key grpo.max_num_step; did you mean grpo.max_num_steps?",
        ),
        (["grpo.max_num_steps=abc"], "grpo.max_num_steps: expected int, got str 'abc'"),
        (["policy.train_global_batch_size=1.5"], "expected int, got float 1.5"),
        (["data.shuffle=1"], "data.shuffle: expected bool, got int 1"),
        (["policy.optimizer=3"], "policy.optimizer: "),
        (
            ["generation.vllm.tensor_parallel_sise=2"],
            "unknown key generation.vllm.tensor_parallel_sise; did you mean "
            "generation.vllm.tensor_parallel_size?",
        ),
        (["generation.vllmm.x=1"], "unknown key generation.vllmm; did you mean generation.vllm?"),
        (["generation.nothing_like_it.x=1"], "no generation named 'nothing_like_it' is registered"),
        (
            ["policy.megatron.tensor_model_parallel_size=two"],
            "policy.megatron.tensor_model_parallel_size: expected int, got str 'two'",
        ),
        # A section's key without its section (issue 39: `max_num_steps=5` got no hint).
        (["max_num_steps=5"], "unknown key max_num_steps; did you mean grpo.max_num_steps?"),
        (["lr=1e-5"], "unknown key lr; did you mean policy.optimizer.lr?"),
        (["max_num_stps=5"], "unknown key max_num_stps; did you mean grpo.max_num_steps?"),
        (["justakey"], "override 'justakey' must look like key.path=value"),
        (["seed.sub=1"], "seed: expected int, got a section"),
        (["seed=1", "seed.sub=1"], "seed is a value, not a section"),
    ],
)
def test_bad_values_name_the_full_key_path(overrides, message, registry):
    with pytest.raises(ConfigError) as excinfo:
        resolve_config("grpo", None, overrides, registry)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_bad_yaml_names_file_and_line(tmp_path, registry):
    bad = write(tmp_path / "bad.yaml", "seed: 1\npolicy:\n  lr: [1, 2\n  other: 3\n")
    with pytest.raises(ConfigError, match=r"bad YAML in .*bad\.yaml, line \d+, column \d+"):
        resolve_config("grpo", bad, registry=registry)


def test_missing_file_and_non_mapping_file(tmp_path, registry):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config("grpo", tmp_path / "nope.yaml", registry=registry)
    with pytest.raises(ConfigError, match="must hold a mapping"):
        resolve_config("grpo", write(tmp_path / "list.yaml", "- 1\n- 2\n"), registry=registry)


def test_component_options_use_the_plugin_config_class(registry):
    config = resolve_config(
        "grpo",
        None,
        ["generation.backend=vllm", "generation.vllm.tensor_parallel_size=4"],
        registry,
    )
    options = config.generation.options_for()
    assert type(options).__name__ == "VllmConfig"
    assert options.tensor_parallel_size == 4
    # The selected component always has its (default) options, even when not written.
    assert (
        type(resolve_config("grpo", None, [], registry).policy.options_for()).__name__
        == "DTensorConfig"
    )


def test_plugin_contributes_a_config_section_for_one_test(registry):
    @attrs.define
    class EchoOptions:
        repeat: int = option(1, "how often to echo")

    class Plugin:
        @hookimpl
        def nrl_register_environments(self, register):
            register("echo", "x:y", config=EchoOptions)

    host = PluginHost.discover(selection=[])
    host.add(Plugin(), "echo-plugin")
    config = resolve_config("grpo", None, ["env.name=echo", "env.echo.repeat=3"], host.registry())
    assert config.env.options_for() == EchoOptions(repeat=3)
    with pytest.raises(
        ConfigError, match=r"unknown key env\.echo\.repaet; did you mean env\.echo\.repeat"
    ):
        resolve_config("grpo", None, ["env.echo.repaet=3"], host.registry())


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_CONFIGS))
def test_dump_round_trips(algorithm, registry):
    config = resolve_config(algorithm, None, ["seed=3"], registry)
    text = dump_config(config, registry)
    again = ConfigConverter(registry).structure(parse_yaml(text), type(config))
    assert again == config


def test_every_config_field_is_documented():
    seen = set()

    def walk(cls):
        if cls in seen:
            return
        seen.add(cls)
        attrs.resolve_types(cls)
        for field in attrs.fields(cls):
            if field.name != "options":
                assert field.metadata.get("doc"), f"{cls.__name__}.{field.name} has no doc"
            if isinstance(field.type, type) and attrs.has(field.type):
                walk(field.type)

    for cls in ALGORITHM_CONFIGS.values():
        walk(cls)
    assert len(seen) > 8


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00", r"config file .*cfg\.yaml is a binary file, not YAML"),
        (b"seed: 1\nlogger: {run_name: caf\xe9}\n", r"cfg\.yaml, line 2: not UTF-8 text \(byte 0xe9\)"),
        (b"just words\n", r"must hold a mapping of config keys \(key: value lines\), not a plain string"),
        (b"1: one\n", r"cfg\.yaml: config keys are names, not int 1"),
        (b"seed: \x01\n", r"bad YAML in .*cfg\.yaml: unacceptable character"),
    ],
)  # fmt: skip
def test_unreadable_config_files_are_one_line(tmp_path, registry, content, message):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_config("grpo", path, registry=registry)
    assert "\n" not in str(error.value)


def test_a_folder_given_as_config_file(tmp_path, registry):
    with pytest.raises(ConfigError, match=r"is a folder; pass a YAML file"):
        resolve_config("grpo", tmp_path, registry=registry)


def test_defaults_may_name_an_embedded_recipe(tmp_path, registry):
    """``defaults: grpo`` builds on what `nrl run grpo` runs without --config (not on the
    class defaults), and the file's own keys still win."""
    run = write(tmp_path / "run.yaml", "defaults: grpo\ngrpo: {max_num_steps: 7}\n")
    config = resolve_config("grpo", run, registry=registry)
    assert config.grpo.max_num_steps == 7
    assert config.generation.max_new_tokens == 4  # the recipe's, not the class default 128
    assert config.policy.optimizer.lr == 3.0e-4
    assert config.logger.run_name == "grpo-arithmetic"


def test_an_unknown_defaults_entry_names_files_and_recipes(tmp_path, registry):
    run = write(tmp_path / "run.yaml", "defaults: grpoo\n")
    with pytest.raises(ConfigError, match=r"'grpoo' is neither a file .* nor an embedded recipe"):
        resolve_config("grpo", run, registry=registry)


def _without_math_env() -> Registry:
    """The core and nrl-dtensor only: an installation without nrl-math-env, whose
    `arithmetic` dataset and environment the grpo recipe selects and configures."""
    return PluginHost.discover(selection=["dtensor"]).registry()


@pytest.mark.parametrize("as_file", [False, True])
def test_recipe_options_of_components_not_installed_are_left_out(tmp_path, as_file):
    """The grpo recipe carries `data.arithmetic` (nrl-math-env); a run that selects another
    dataset and environment must not need that plugin (issue 20: `unknown key
    data.arithmetic` in a venv holding nrl-core, nrl-dtensor and the user's plugin)."""
    registry = _without_math_env()
    assert registry.find("dataset", "arithmetic") is None
    overrides = ["data.dataset=preference", "env.name=exact_match"]
    if as_file:
        run = write(tmp_path / "run.yaml", "defaults: grpo\ngrpo: {max_num_steps: 7}\n")
        config = resolve_config("grpo", run, overrides, registry)
        assert config.grpo.max_num_steps == 7
    else:
        config = resolve_config("grpo", None, overrides, registry, defaults=default_recipe("grpo"))
    assert config.data.dataset == "preference"
    assert "arithmetic" not in config.data.options
    assert config.policy.optimizer.lr == 3.0e-4  # the rest of the recipe still applies


def test_options_the_user_writes_for_a_component_not_installed_stay_an_error(tmp_path):
    registry = _without_math_env()
    run = write(
        tmp_path / "run.yaml", "defaults: grpo\ndata: {dataset: preference, arithmetic: {}}\n"
    )
    with pytest.raises(ConfigError, match=r"unknown key data\.arithmetic"):
        resolve_config("grpo", run, ["env.name=exact_match"], registry)
    with pytest.raises(ConfigError, match=r"unknown key data\.arithmetic"):
        resolve_config(
            "grpo",
            None,
            ["data.dataset=preference", "env.name=exact_match", "data.arithmetic.num_digits=2"],
            registry,
            defaults=default_recipe("grpo"),
        )


def test_a_jsonl_path_as_dataset_shows_the_options_that_read_it(registry):
    """`data.dataset=<file>.jsonl` is read by the math plugin's `jsonl` dataset, whose prompt
    template and task shape every prompt: `config show` must list them (issue 20)."""
    config = resolve_config("grpo", None, ["data.dataset=/data/train.jsonl"], registry)
    shown = parse_yaml(dump_config(config, registry))["data"]["jsonl"]
    assert "\\boxed{}" in shown["prompt_template"] and shown["task"] == "math"


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = ['a0: &a0 ["lol"' + ', "lol"' * (width - 1) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\ngrpo: {{max_num_steps: *a{levels - 1}}}\n"


def test_an_alias_bomb_is_refused_at_once(tmp_path, registry):
    """Issue 47: nine aliases of nine (387 million values) took the checks after parsing 24-30 s
    of CPU before their refusal; the expansion is counted on the parsed node graph instead."""
    import time

    path = write(tmp_path / "bomb.yaml", _alias_bomb())
    started = time.process_time()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: its aliases \(\*name\) repeat \d+ values"):
        resolve_config("grpo", path, registry=registry)
    assert time.process_time() - started < 1.0
    with pytest.raises(Exception, match=r"refers to the value that holds it"):
        parse_yaml("a: &x [1, *x]\n")


def test_aliases_that_repeat_a_few_values_still_load():
    from nrl_core.config.yaml_text import MAX_ALIAS_EXPANSION

    assert parse_yaml("a: &x [1, 2]\nb: *x\nc: {<<: {k: 1}, j: 2}\n") == {
        "a": [1, 2],
        "b": [1, 2],
        "c": {"k": 1, "j": 2},
    }
    # Around the bound: five levels of eight aliases repeat 80,233 values, of nine 141,148.
    assert MAX_ALIAS_EXPANSION == 100_000
    assert len(parse_yaml(_alias_bomb(levels=5, width=8))["grpo"]["max_num_steps"]) == 8
    with pytest.raises(Exception, match=r"over the 100000 allowed"):
        parse_yaml(_alias_bomb(levels=5, width=9))


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n  # and another\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, registry, content):
    """Issue 47: an empty or comments-only --config trained on the defaults in silence."""
    path = write(tmp_path / "cfg.yaml", content)
    with pytest.raises(ConfigError, match=r"cfg\.yaml holds no settings \(it is empty or only"):
        resolve_config("grpo", path, registry=registry)
    assert resolve_config("grpo", write(tmp_path / "none.yaml", "{}\n"), registry=registry)


def test_defaults_share_no_nested_section_between_configs():
    """Each config gets its own copy of every default section, however deep: setting a nested
    option on one (``config.grpo.async_.enabled``) once changed every later default config
    (``option`` copied the default section shallowly), and the quick tier's config tests failed
    after a test that did so ran in the same process."""
    from nrl_core.config.schema import GRPOConfig

    first = GRPOConfig()
    first.grpo.async_.enabled = True
    first.policy.optimizer.lr = 0.5
    first.data.options["extra"] = 1
    second = GRPOConfig()
    assert second.grpo.async_.enabled is False
    assert second.policy.optimizer.lr != 0.5
    assert "extra" not in second.data.options
