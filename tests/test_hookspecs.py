"""Every hook is documented and typed, and maps to a component kind."""

import inspect

from nrl_core import hookspecs
from nrl_core.plugins import HOOK_KINDS
from nrl_core.registry import KINDS


def _hooks():
    return {
        name: fn for name, fn in vars(hookspecs).items() if name.startswith("nrl_") and callable(fn)
    }


def test_every_hook_has_a_docstring_naming_its_interface_and_config_section():
    hooks = _hooks()
    assert set(hooks) == set(HOOK_KINDS)
    for name, fn in hooks.items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc.splitlines()) >= 3, f"{name} is not documented"
        assert "nrl_core.interfaces." in doc, f"{name} does not name the interface it expects"
        assert "Options come from" in doc, f"{name} does not say where options come from"


def test_every_hook_takes_one_typed_register_argument():
    for name, fn in _hooks().items():
        signature = inspect.signature(fn)
        assert list(signature.parameters) == ["register"], name
        assert signature.parameters["register"].annotation == "Register", name


def test_hooks_cover_every_component_kind_once():
    assert sorted(HOOK_KINDS.values()) == sorted(KINDS)
