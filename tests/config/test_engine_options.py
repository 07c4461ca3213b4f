"""The engine fields the core reads (placement, refit) are declared once, in
:class:`~nrl_core.config.schema.EngineOptions`, and every engine plugin's options extend it."""

from __future__ import annotations

import attrs
import pytest

from nrl_core.config.schema import EngineOptions, FieldValueError
from nrl_core.plugins import PluginHost
from nrl_core.testing.recording import RecordingEngineConfig

CORE_READS = {
    "num_engines",
    "tensor_parallel_size",
    "colocated",
    "refit_bucket_mb",
    "refit_transport",
    "dtype",
}


def _engine_option_classes():
    """The options class of every registered generation backend that starts separate engines
    (not the one that runs in the policy workers), and the test-only recording engine."""
    registry = PluginHost.discover().registry()
    classes = [
        spec.load_config_class()
        for spec in registry
        if spec.kind == "generation" and spec.name in ("vllm", "sglang")
    ]
    return [*classes, RecordingEngineConfig]


def test_the_base_holds_the_fields_the_core_reads():
    assert {field.name for field in attrs.fields(EngineOptions)} == CORE_READS


@pytest.mark.parametrize("cls", _engine_option_classes(), ids=lambda cls: cls.__name__)
def test_every_engine_plugin_extends_the_base(cls):
    assert issubclass(cls, EngineOptions)
    # The ranges come with the base: a plugin cannot forget one.
    for field, bad in (("num_engines", 0), ("tensor_parallel_size", 0), ("refit_bucket_mb", 0)):
        with pytest.raises(FieldValueError, match=f"{field} must be >= 1"):
            cls(**{field: bad})
    with pytest.raises(ValueError, match="refit_transport"):
        cls(refit_transport="carrier-pigeon")
