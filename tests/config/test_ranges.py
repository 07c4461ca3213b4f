"""Valid ranges of config fields (attrs validators in nrl_core.config.schema): every numeric
field has one, it runs for YAML and for attrs.evolve in code, and a value outside it is one
line naming the full dotted key."""

from __future__ import annotations

import types
import typing

import attrs
import pytest

from nrl_core.config.loader import resolve_config
from nrl_core.config.schema import (
    ALGORITHM_CONFIGS,
    EvalConfig,
    FieldValueError,
    GRPOConfig,
    OptimizerConfig,
    describe_validator,
)
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginHost

NUMERIC = (int, float)


@pytest.fixture(scope="module")
def registry():
    return PluginHost.discover().registry()


def _config_classes(registry):
    seen: set[type] = set()

    def walk(cls):
        if cls in seen:
            return
        seen.add(cls)
        attrs.resolve_types(cls)
        for field in attrs.fields(cls):
            if isinstance(field.type, type) and attrs.has(field.type):
                walk(field.type)

    for cls in [*ALGORITHM_CONFIGS.values(), EvalConfig]:
        walk(cls)
    for spec in registry:
        if spec.config is not None:
            walk(spec.load_config_class())
    return seen


def _is_numeric(tp) -> bool:
    """int, float, their optionals, and lists of them (bool is a flag, not a number)."""
    if tp in NUMERIC:
        return True
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _is_numeric(args[0])
    return origin is list and len(args) == 1 and args[0] in NUMERIC


def test_every_numeric_field_of_every_config_class_has_a_valid_range(registry):
    classes = _config_classes(registry)
    assert len(classes) > 25  # the core sections and every plugin's options
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{field.name}"
        for cls in classes
        for field in attrs.fields(cls)
        if _is_numeric(field.type) and describe_validator(field.validator) is None
    ]
    assert not missing, f"numeric config fields without a validator: {missing}"


def test_validators_run_when_a_config_is_changed_in_code():
    with pytest.raises(FieldValueError) as error:
        attrs.evolve(OptimizerConfig(), lr=-1.0)
    assert str(error.value) == "lr must be > 0, got -1"
    assert (error.value.field, error.value.problem) == ("lr", "must be > 0, got -1")
    config = GRPOConfig()
    with pytest.raises(ValueError, match=r"'precision' must be in"):
        attrs.evolve(config.policy, precision="float8")
    with pytest.raises(FieldValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        attrs.evolve(config.generation, top_p=1.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policy.optimizer.lr=-1"], "policy.optimizer.lr must be > 0, got -1"),
        (["seed=-3"], "seed must be >= 0, got -3"),
        (["policy.precision=float8"], "policy.precision must be one of float32, bfloat16, got 'float8'"),
        (["loss.clipped_pg.kl_estimator=k4"], "loss.clipped_pg.kl_estimator must be one of k1, k2, k3, got 'k4'"),
        (["loss.clipped_pg.dual_clip_c=1"], "loss.clipped_pg.dual_clip_c must be > 1 (commonly 3) or null, got 1"),
        (["generation.vllm.sleep_level=0"], "generation.vllm.sleep_level must be one of 1, 2, got 0"),
        (["data.arithmetic.operations=[\"/\"]"], "data.arithmetic.operations must be one of"),
        (["policy.micro_batch_token_budget=0"], "policy.micro_batch_token_budget must be >= 1 or null, got 0"),
        (["generation.max_new_tokens=512"], "generation.max_new_tokens=512 leaves no room for a prompt in policy.max_total_sequence_length=512"),
    ],
)  # fmt: skip
def test_out_of_range_values_name_the_full_key(overrides, message, registry):
    with pytest.raises(ConfigError) as error:
        resolve_config("grpo", None, overrides, registry)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_a_literal_typed_option_lists_its_choices(registry):
    # Literal types are checked by the structuring hook before the validator runs: same words.
    with pytest.raises(
        ConfigError, match=r"loss\.clipped_pg\.ratio_level must be one of token, sequence, got 1$"
    ):
        resolve_config("grpo", None, ["loss.clipped_pg.ratio_level=1"], registry)  # fmt: skip


def test_describe_validator_reads_attrs_own_validators():
    assert describe_validator(attrs.validators.ge(1)) == ">= 1"
    assert describe_validator(attrs.validators.in_(("a", "b"))) == "one of `a`, `b`"
    assert (
        describe_validator(attrs.validators.optional(attrs.validators.lt(0.5))) == "< 0.5 or null"
    )
    both = attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(1))
    assert describe_validator(both) == ">= 0 and <= 1"
    assert describe_validator(lambda *_: None) is None
