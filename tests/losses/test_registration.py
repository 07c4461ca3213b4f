"""The built-in losses are registered lazily, and their configs load without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nrl_core.config.loader import resolve_config
from nrl_core.interfaces import LossFunction
from nrl_core.plugins import PluginHost


@pytest.fixture(scope="module")
def registry():
    host = PluginHost(selection=[])
    host.load_builtins()
    return host.registry()


@pytest.mark.parametrize("name", ["clipped_pg", "nll", "dpo"])
def test_builtin_losses_load_and_honour_the_protocol(registry, name):
    spec = registry.get("loss", name)
    assert spec.plugin == "core"
    config_cls = spec.load_config_class()
    loss = spec.load()(config_cls(), None)
    assert isinstance(loss, LossFunction)


def test_config_sections_structure_into_the_loss_options(registry):
    config = resolve_config(
        "grpo",
        overrides=["loss.clipped_pg.clip_eps_high=0.28", "loss.clipped_pg.kl_coef=0.01"],
        registry=registry,
    )
    options = config.loss.options_for()
    assert (options.clip_eps_high, options.kl_coef, options.is_correction) == (0.28, 0.01, "auto")


def test_registration_and_configs_do_not_import_torch():
    code = (
        "import sys\n"
        "from nrl_core.plugins import PluginHost\n"
        "host = PluginHost(selection=[]); host.load_builtins()\n"
        "for name in ('clipped_pg', 'nll', 'dpo'):\n"
        "    host.registry().get('loss', name).load_config_class()\n"
        "import nrl_core.losses\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
