"""What every suite shares: a conversation in a line, and the check that a plugin registers the
component a suite tests."""

from __future__ import annotations

from typing import Any

import attrs

from nrl_core.data import Message


def conversation(prompt: str, response: str, system: str | None = None) -> list[Message]:
    """A one-turn conversation as the core hands it to ``Environment.step``."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return messages


def _registered(kind: str, name: str):
    """The spec of ``kind``/``name`` from every installed plugin (fails with nrl's message)."""
    from nrl_core.plugins import PluginHost

    host = PluginHost.discover()
    broken = {i.name: i.error for i in host.broken()}
    assert not broken, f"plugins failed to load: {broken}"
    return host.registry().get(kind, name)  # type: ignore[arg-type]


def _check_registration(kind: str, name: str, component: Any) -> None:
    spec = _registered(kind, name)
    target = spec.load()
    assert isinstance(component, target), (
        f"{kind} {name!r} is registered as {spec.target_str}, but the tested component is a "
        f"{type(component).__module__}.{type(component).__qualname__}"
    )
    config_class = spec.load_config_class()
    if config_class is not None:
        assert attrs.has(config_class), f"config class of {kind} {name!r} must be an attrs class"
        config_class()  # every option needs a default: configs may leave the section out
        undocumented = [f.name for f in attrs.fields(config_class) if not f.metadata.get("doc")]
        assert not undocumented, (
            f"options of {kind} {name!r} without documentation (use nrl_core.config.schema."
            f"option(default, doc)): {undocumented}"
        )
