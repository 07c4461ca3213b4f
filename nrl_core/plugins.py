"""Plugin discovery and loading: entry points, per-plugin errors, selection, de-duplication.

Plugins are modules named by entry points in the ``nrl.plugins`` group; the entry point's name is
the plugin's short name. The core's own components (``nrl_core.builtins``) load through the same
manager under the name ``core``. One broken plugin never stops nrl: its import error, its
misspelled hook or its failing hook is recorded on its :class:`PluginInfo` and it is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any, Literal

import attrs
import pluggy

from nrl_core import PROJECT_NAME, __version__, hookspecs
from nrl_core.errors import PluginError
from nrl_core.registry import ComponentKind, ComponentSpec, Registry, make_spec

ENTRY_POINT_GROUP = "nrl.plugins"
CORE_PLUGIN = "core"
PLUGINS_ENV_VAR = "NRL_PLUGINS"

HOOK_KINDS: dict[str, ComponentKind] = {
    "nrl_register_policies": "policy",
    "nrl_register_generations": "generation",
    "nrl_register_environments": "environment",
    "nrl_register_agents": "agent",
    "nrl_register_losses": "loss",
    "nrl_register_clusters": "cluster",
    "nrl_register_datasets": "dataset",
    "nrl_register_tool_parsers": "tool_parser",
}


@attrs.define
class PluginInfo:
    """What ``nrl plugins`` reports about one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    components: list[ComponentSpec] = attrs.field(factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "components": [
                {"kind": c.kind, "name": c.name, "target": c.target_str} for c in self.components
            ],
        }


def parse_selection(
    cli_values: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> frozenset[str] | None:
    """Which plugins to load: ``--plugin`` values win over ``NRL_PLUGINS``; ``None`` means all.

    Values may be repeated or comma separated. ``NRL_PLUGINS=`` (set but empty) selects no
    third-party plugin, leaving only the built-ins.
    """
    environ = os.environ if environ is None else environ
    if cli_values:
        raw: Iterable[str] = cli_values
    elif PLUGINS_ENV_VAR in environ:
        raw = [environ[PLUGINS_ENV_VAR]]
    else:
        return None
    return frozenset(p.strip() for item in raw for p in item.split(",") if p.strip())


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class PluginHost:
    """A typed wrapper over :class:`pluggy.PluginManager` that knows nrl's loading rules.

    Args:
        selection: short names of the third-party plugins to load (``None``: all installed).
    """

    def __init__(self, selection: Collection[str] | None = None) -> None:
        self.selection = None if selection is None else frozenset(selection) - {CORE_PLUGIN}
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._infos: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def discover(cls, selection: Collection[str] | None = None) -> PluginHost:
        """Load the built-ins and every installed plugin (or the selected ones)."""
        host = cls(selection)
        host.load_builtins()
        host.load_entry_points()
        return host

    def load_builtins(self) -> PluginInfo:
        from nrl_core import builtins

        return self.add(builtins, CORE_PLUGIN, distribution="nrl-core", version=__version__)

    def load_entry_points(self) -> None:
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist_name = ep.dist.name if ep.dist is not None else None
            if ep.name in found:
                first = found[ep.name]
                first_dist = first.dist.name if first.dist is not None else None
                if _canonical(first_dist) == _canonical(dist_name):
                    continue  # the same distribution seen twice on sys.path
                self._infos[f"{ep.name} ({dist_name})"] = PluginInfo(
                    name=ep.name,
                    distribution=dist_name,
                    version=ep.dist.version if ep.dist else None,
                    status="error",
                    error=f"plugin name {ep.name!r} is already used by distribution {first_dist}",
                )
                continue
            found[ep.name] = ep
        if self.selection is not None:
            unknown = sorted(self.selection - set(found))
            if unknown:
                installed = ", ".join(sorted(found)) or "none"
                raise PluginError(
                    f"unknown plugin {', '.join(map(repr, unknown))} in --plugin/{PLUGINS_ENV_VAR};"
                    f" installed plugins: {installed}"
                )
        for name, ep in sorted(found.items()):
            if self.selection is not None and name not in self.selection:
                continue
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist else (None, None)
            try:
                module = ep.load()
            except BaseException as exc:  # a plugin's import must never take nrl down
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._infos[name] = PluginInfo(
                    name, dist, version, status="error", error=f"import failed: {_describe(exc)}"
                )
                continue
            self.add(module, name, distribution=dist, version=version)

    def add(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginInfo:
        """Register a plugin object (a module, or any object with hook implementations).

        Tests use this to register a plugin for one test and :meth:`remove` it afterwards.
        """
        if name in self._infos:
            raise PluginError(f"a plugin named {name!r} is already loaded")
        info = PluginInfo(name, distribution, version)
        self._infos[name] = info
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            info.status, info.error = "error", _describe(exc)
            return info
        self._objects[name] = plugin
        unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if not hc.has_spec()]
        if unknown:
            self._fail(
                info,
                f"hook implementation {', '.join(unknown)} matches no nrl hook "
                f"(known hooks: {', '.join(HOOK_KINDS)})",
            )
            return info
        for hook_name, kind in HOOK_KINDS.items():
            others = [p for p in self.pm.get_plugins() if p is not plugin]
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
            try:
                caller(register=self._register_function(info, kind))
            except Exception as exc:
                self._fail(info, f"{hook_name} failed: {_describe(exc)}")
                return info
        return info

    def remove(self, name: str) -> None:
        """Unregister a plugin added with :meth:`add` (or discovered)."""
        self._infos.pop(name, None)
        plugin = self._objects.pop(name, None)
        if plugin is not None:
            self.pm.unregister(plugin)

    def _fail(self, info: PluginInfo, error: str) -> None:
        info.status, info.error, info.components = "error", error, []
        plugin = self._objects.pop(info.name, None)
        if plugin is not None:
            self.pm.unregister(plugin)

    @staticmethod
    def _register_function(info: PluginInfo, kind: ComponentKind):
        def register(name: str, target: str | object, **kwargs: Any) -> None:
            info.components.append(
                make_spec(kind, info.name, info.distribution, name, target, **kwargs)
            )

        return register

    # -- results ---------------------------------------------------------------------------

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, built-ins first, then by name."""
        return sorted(self._infos.values(), key=lambda i: (i.name != CORE_PLUGIN, i.name))

    def broken(self) -> list[PluginInfo]:
        return [i for i in self.plugins if i.status == "error"]

    def conflicts(self) -> list[str]:
        """One message per component name registered by more than one plugin."""
        owners: dict[tuple[str, str], list[PluginInfo]] = {}
        for info in self.plugins:
            for spec in info.components:
                owners.setdefault((spec.kind, spec.name), []).append(info)
        messages = []
        for (kind, name), infos in sorted(owners.items()):
            if len(infos) > 1:
                who = " and ".join(
                    f"plugin {i.name!r} ({i.distribution or 'in-process'})" for i in infos
                )
                messages.append(
                    f"{kind} {name!r} is registered by both {who}; load only one of them with "
                    f"--plugin NAME or {PLUGINS_ENV_VAR}=NAME,..."
                )
        return messages

    def registry(self) -> Registry:
        """All components of the plugins that loaded; raises :class:`PluginError` on conflicts."""
        conflicts = self.conflicts()
        if conflicts:
            raise PluginError(conflicts[0])
        return Registry([spec for info in self.plugins for spec in info.components])


def _canonical(name: str | None) -> str | None:
    return None if name is None else name.lower().replace("_", "-").replace(".", "-")
