"""``nrl venvs``: build, list and clean the per-plugin actor virtualenvs.

Kept import-light: the actor-env module and the plugin host are imported inside the handlers,
and Ray never is (``build`` builds on this node; runs build on every node themselves).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Add ``venvs`` and its ``build``/``list``/``clean`` subcommands to ``subparsers``."""
    venvs = subparsers.add_parser(
        "venvs",
        help="build, list and clean the per-plugin actor virtualenvs",
        description="Actor virtualenvs live under <workspace>/venvs (or $NRL_VENV_DIR), one "
        "per plugin distribution, extras and lockfile hash.",
    )
    venvs.set_defaults(handler=lambda args: (venvs.print_help(), 0)[1])
    sub = venvs.add_subparsers(dest="venvs_command", metavar="COMMAND")

    build = sub.add_parser("build", help="build (or reuse) the venvs of plugins")
    build.add_argument(
        "plugins",
        nargs="*",
        metavar="PLUGIN",
        help="plugin short names, optionally with extras: 'dtensor[lora]' (the venv of "
        "policy.dtensor.lora_rank > 0)",
    )
    build.add_argument("--all", action="store_true", help="every installed plugin")
    build.add_argument(
        "--bin", metavar="DIR", help="also write a python-<plugin> launcher per venv into DIR"
    )
    build.add_argument(
        "--force",
        action="store_true",
        help="rebuild even when a fresh venv exists (as NRL_FORCE_REBUILD_VENVS=1)",
    )
    build.set_defaults(handler=_build)

    listing = sub.add_parser("list", help="show the venvs and whether they are fresh")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=_list)

    clean = sub.add_parser("clean", help="delete venvs")
    clean.add_argument(
        "--stale",
        action="store_true",
        help="delete only stale and broken venvs, keep the fresh ones",
    )
    clean.set_defaults(handler=_clean)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _venv_root():
    from nrl_core.distributed.actor_env import default_venv_root, find_workspace_root

    return default_venv_root(find_workspace_root())


def _parse_target(text: str) -> tuple[str, tuple[str, ...]]:
    """``dtensor`` -> ``("dtensor", ())``; ``dtensor[lora]`` -> ``("dtensor", ("lora",))``."""
    import re

    from nrl_core.errors import PluginError

    match = re.fullmatch(r"\s*([A-Za-z0-9][\w.-]*)\s*(?:\[([^\]]*)\])?\s*", text)
    extras = () if match is None else tuple(e.strip() for e in (match[2] or "").split(","))
    if match is None or (match[2] is not None and not all(extras)):
        raise PluginError(
            f"`{text}` is not a plugin name or NAME[EXTRA,...]; e.g. nrl venvs build dtensor "
            "'dtensor[lora]'"
        )
    return match[1], tuple(e for e in extras if e)


def _check_extras(plugin: str, distribution: str, extras: tuple[str, ...]) -> None:
    """Refuse extras that ``distribution`` does not declare (uv would ignore them silently)."""
    from importlib import metadata

    from nrl_core.distributed.actor_env import canonical_name
    from nrl_core.errors import PluginError

    declared = metadata.metadata(distribution).get_all("Provides-Extra") or []
    known = {canonical_name(e) for e in declared}
    for extra in extras:
        if canonical_name(extra) not in known:
            raise PluginError(
                f"plugin {plugin!r} ({distribution}) has no extra {extra!r}; its extras: "
                f"{', '.join(sorted(declared)) or 'none'}"
            )


def _targets(names: list[str], all_plugins: bool, host: Any = None) -> list[tuple[Any, ...]]:
    """(plugin, distribution, extras, cpu_install) of every actor venv the selected plugins
    need; ``cpu_install``: the :class:`~nrl_core.distributed.actor_env.CpuInstall` that a
    component with those extras registered (its venv differs on a machine without GPUs), or
    None.

    A name may carry extras, ``dtensor[lora]``: that plugin's venvs are built with them added,
    the venv a run gets for settings that need them (``policy.dtensor.lora_rank`` > 0; see
    :func:`nrl_core.distributed.actor_env.component_extras`). ``host``: the loaded plugins
    (default: discovered, the selected ones).
    """
    from nrl_core.distributed.actor_env import ACTOR_KINDS, cpu_install_of
    from nrl_core.errors import PluginError
    from nrl_core.plugins import CORE_PLUGIN, PluginHost

    if not names and not all_plugins:
        raise PluginError("name the plugins to build (nrl venvs build dtensor vllm) or pass --all")
    requested: dict[str, set[str]] = {}
    for text in names:
        name, extras = _parse_target(text)
        requested.setdefault(name, set()).update(extras)
    if host is None:
        host = PluginHost.discover(None if all_plugins else list(requested))
    targets: list[tuple[Any, ...]] = []
    for info in host.plugins:
        if info.name == CORE_PLUGIN or info.status != "ok" or not info.distribution:
            continue
        added = tuple(sorted(requested.get(info.name, ())))
        _check_extras(info.name, info.distribution, added)
        # A dataset's extras (the hub's `datasets`) are for the driver: no venv of their own.
        combos: dict[tuple[str, ...], Any] = {}
        for spec in info.components:
            if spec.kind in ACTOR_KINDS:
                extras = tuple(sorted({*spec.extras, *added}))
                combos[extras] = combos.get(extras) or cpu_install_of(spec)
        for extras in sorted(combos or {added: None}):
            targets.append((info.name, info.distribution, extras, combos.get(extras)))
    broken = [i for i in host.broken() if all_plugins or i.name in requested]
    if broken:
        raise PluginError(
            f"plugin {broken[0].name!r} failed to load: {broken[0].error}; "
            "fix it or leave it out of `nrl venvs build`"
        )
    return targets


def _build(args: argparse.Namespace) -> int:
    import os

    from rich.markup import escape

    from nrl_core.distributed import actor_env

    console = _console()
    root = _venv_root()
    force = args.force or actor_env._truthy(os.environ.get(actor_env.FORCE_VAR))
    taken: set[str] = set()
    on_gpu: bool | None = None
    for plugin, distribution, extras, cpu_install in _targets(args.plugins, args.all):
        request = actor_env.request_for(distribution, extras, plugin)
        if cpu_install is not None:
            # The venv a run gets here: without GPUs, the component's CPU install.
            on_gpu = actor_env.machine_has_gpus() if on_gpu is None else on_gpu
            if not on_gpu:
                request = actor_env.cpu_request(request, cpu_install)
        shown = f"[{','.join(request.extras)}]" if request.extras else ""
        if request.variant:
            shown += f", {request.variant}: {' '.join(request.post_install)}"
        # Escaped: rich would take "[env]" (the extras) for a markup tag and drop it.
        label = escape(f"{plugin} ({distribution}{shown})")
        with console.status(f"building {label}..."):
            info = actor_env.build_venv(request, root, force=force)
        state = "[green]built[/]" if info.built else "[cyan]fresh, reused[/]"
        console.print(f"{label}: {state} {escape(str(info.path))}")
        if args.bin:
            name = actor_env.launcher_name(plugin, extras, taken)
            taken.add(name)
            launcher = actor_env.write_launcher(args.bin, name, info.python)
            console.print(f"  launcher: {launcher}")
    return 0


def _human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def _list(args: argparse.Namespace) -> int:
    from nrl_core.distributed.actor_env import list_venvs

    entries = list_venvs(_venv_root())
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    from rich.table import Table

    console = _console()
    if not entries:
        console.print(f"no actor venvs under {_venv_root()}; build them with `nrl venvs build`")
        return 0
    table = Table("plugin", "extras", "lock hash", "size", "status", "path")
    colours = {"fresh": "green", "stale": "yellow", "broken": "red"}
    for e in entries:
        table.add_row(
            f"{e.plugin or '?'} ({e.variant})" if e.variant else e.plugin or "?",
            ",".join(e.extras) or "-",
            e.fingerprint[:12],
            _human_size(e.size_bytes),
            f"[{colours[e.status]}]{e.status}[/]",
            str(e.path),
        )
    console.print(table)
    return 0


def _clean(args: argparse.Namespace) -> int:
    from nrl_core.distributed.actor_env import clean_venvs

    removed = clean_venvs(_venv_root(), stale_only=args.stale)
    console = _console()
    for path in removed:
        console.print(f"removed {path}")
    if not removed:
        console.print("nothing to remove")
    return 0
