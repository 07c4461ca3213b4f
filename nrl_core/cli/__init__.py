"""The ``nrl`` command.

Start-up must stay fast: this module imports only the standard library at import time. Each
sub-command imports what it needs inside its handler, and torch, ray and transformers are
imported only by commands that run or inspect models.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from nrl_core.errors import ConfigError

ALGORITHMS = ("grpo", "ppo", "sft", "dpo", "rm", "distill")

_EPILOG = """\
examples:
  nrl run grpo                                  the CPU demo: GRPO on arithmetic, tiny model
  nrl run grpo --config my.yaml policy.optimizer.lr=1e-5
  nrl plugins --json                            installed plugins and what they register
  nrl config show grpo --config my.yaml         the fully resolved config
"""


def _plugin_option(parser: argparse.ArgumentParser) -> None:
    # -v/-q are accepted after the sub-command too (`nrl run grpo -q`); SUPPRESS keeps a value
    # given before it.
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="more output"
    )
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="only errors"
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="load only these plugins (repeatable or comma separated; default: all installed, "
        "or $NRL_PLUGINS)",
    )


class _RunHelp(argparse.Action):
    """``nrl run [ALGO] --help``: with ALGO (parsed before ``--help``), its config sections and
    how to see every option (read from the config schema: attrs only, no plugin, no torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        algorithm = getattr(namespace, "algorithm", None)
        if algorithm in ALGORITHMS:
            from nrl_core.config.reference import run_help

            parser.epilog = run_help(algorithm)
        parser.print_help()
        parser.exit()


class _UsageError(ConfigError):
    """A command line argparse cannot parse (an unknown algorithm, a missing argument)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``error: nrl run: ...``, exit 2) instead of
    the usage text and a second line; sub-commands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message}; see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nrl",
        description="nrl: RL post-training for LLMs (GRPO, SFT, DPO, reward models) built from "
        "plugins.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from nrl_core import __version__

    parser.add_argument("--version", action="version", version=f"nrl {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="more output")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="only errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="train: nrl run {grpo,ppo,sft,dpo,rm,distill} [--config FILE] [KEY=VALUE...]",
        description="Run a training algorithm.",
        epilog="`nrl run ALGO --help` lists ALGO's config sections; `nrl config show --docs "
        "ALGO` describes every option.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    run.add_argument(
        "-h", "--help", action=_RunHelp, nargs=0, help="show this help (with ALGO: its sections)"
    )
    run.add_argument(
        "algorithm", choices=ALGORITHMS, metavar="ALGO", help=f"one of {', '.join(ALGORITHMS)}"
    )
    run.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded recipe)")
    run.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. policy.optimizer.lr=1e-5",
    )
    _plugin_option(run)
    run.set_defaults(handler=_cmd_run)

    plugins = sub.add_parser("plugins", help="list installed plugins and what they register")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    _plugin_option(plugins)
    plugins.set_defaults(handler=_cmd_plugins)

    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the fully resolved config as YAML")
    show.add_argument("algorithm", choices=ALGORITHMS, metavar="ALGO")
    show.add_argument("--config", metavar="FILE")
    show.add_argument(
        "--docs",
        action="store_true",
        help="each option with its description, type, valid range and default (as comments)",
    )
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    _plugin_option(show)
    show.set_defaults(handler=_cmd_config_show)

    doctor = sub.add_parser("doctor", help="check versions, GPUs and each plugin's engine")
    doctor.add_argument(
        "--cluster",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="instead: every node of the running Ray cluster at ADDRESS (default $RAY_ADDRESS): "
        "its Python, nrl, torch and Ray versions, GPUs and free disk, in one table",
    )
    doctor.add_argument(
        "--disk",
        metavar="PATH",
        help="with --cluster: the folder whose free disk each node reports (default: here)",
    )
    _plugin_option(doctor)
    doctor.set_defaults(handler=_cmd_doctor)

    for module in _EXTRA_COMMAND_MODULES:
        _add_extra_commands(sub, module)
    return parser


# Sub-commands that live in their own modules; each module defines ``add_parser(subparsers)``
# and keeps its own imports lazy.
_EXTRA_COMMAND_MODULES = (
    "nrl_core.cli.venvs",
    "nrl_core.cli.plot",
    "nrl_core.cli.new_plugin",
    "nrl_core.cli.convert",
    "nrl_core.cli.eval",
    "nrl_core.cli.serve",
    "nrl_core.cli.slurm",
)


def _add_extra_commands(sub, module_name: str) -> None:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return
    module.add_parser(sub)


# -- handlers -------------------------------------------------------------------------------


def _host(args: argparse.Namespace):
    from nrl_core.plugins import PluginHost, parse_selection

    return PluginHost.discover(parse_selection(args.plugin))


def _warn_broken(host, args: argparse.Namespace) -> None:
    if args.quiet:
        return
    for info in host.broken():
        print(
            f"warning: plugin {info.name!r} is not loaded: {info.error} (see `nrl plugins`)",
            file=sys.stderr,
        )


def _cmd_plugins(args: argparse.Namespace) -> int:
    host = _host(args)
    conflicts = host.conflicts()
    if args.json:
        import json

        print(json.dumps([info.to_json() for info in host.plugins], indent=2))
    else:
        from nrl_core.cli.output import plugins_table

        plugins_table(host.plugins, verbose=args.verbose)
    for message in conflicts:
        print(f"error: {message}", file=sys.stderr)
    return 2 if conflicts else 0


def _resolve(args: argparse.Namespace):
    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.config.loader import resolve_config

    host = _host(args)
    _warn_broken(host, args)
    registry = host.registry()
    config = resolve_config(
        args.algorithm,
        args.config,
        args.overrides,
        registry,
        defaults=None if args.config else default_recipe(args.algorithm),
    )
    return config, registry


def _cmd_config_show(args: argparse.Namespace) -> int:
    config, registry = _resolve(args)
    if args.docs:
        from nrl_core.config.reference import documented_yaml

        sys.stdout.write(documented_yaml(config, registry))
    else:
        from nrl_core.config.loader import dump_config

        sys.stdout.write(dump_config(config, registry))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import importlib

    from nrl_core.errors import NotImplementedYet
    from nrl_core.preflight import preflight

    config, registry = _resolve(args)
    # Before the algorithm's module imports torch (seconds): a wrong path or model name is
    # reported at once. The run's session checks again (milliseconds): a config can also be
    # built in code.
    for note in preflight(config, registry, verbose=args.verbose):
        if not args.quiet:
            print(note, file=sys.stderr)  # the memory plan, before Ray starts
    try:
        module = importlib.import_module(f"nrl_core.algorithms.{args.algorithm}")
    except ModuleNotFoundError as exc:
        if exc.name != f"nrl_core.algorithms.{args.algorithm}":
            raise
        raise NotImplementedYet(
            f"`nrl run {args.algorithm}` is not implemented yet in this version of nrl; "
            "`nrl config show` works and validates your config meanwhile"
        ) from None
    return module.run(config, registry, verbose=args.verbose, quiet=args.quiet) or 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    if args.cluster is not None:
        from nrl_core.cli.doctor import cluster_doctor

        return cluster_doctor(args.cluster or None, disk_path=args.disk)
    if args.disk is not None:
        raise _UsageError("nrl doctor: --disk goes with --cluster; see `nrl doctor --help`")
    from nrl_core.cli.doctor import doctor

    return doctor(_host(args), verbose=args.verbose)


# -- entry point ----------------------------------------------------------------------------


def _print_error_detail(exc: BaseException) -> None:
    """With ``-v``: what a worker error keeps beside its one line (the remote traceback, the
    tail of the worker's log), before that line."""
    for title, text in (
        ("remote traceback", getattr(exc, "remote_traceback", "")),
        ("worker log (tail)", getattr(exc, "log_tail", "")),
    ):
        if text:
            print(f"--- {title} ---\n{text.rstrip()}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nrl`` command; returns the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # argparse gives a positional list only one chance: overrides after an option
        # (`nrl run grpo -q seed=3`) come back here; anything else is a real error.
        if hasattr(args, "overrides"):
            args.overrides += [a for a in extra if "=" in a and not a.startswith("-")]
            extra = [a for a in extra if a not in args.overrides]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    from nrl_core.errors import NrlError

    try:
        return int(args.handler(args) or 0)
    except NrlError as exc:
        if getattr(args, "verbose", False):
            _print_error_detail(exc)
        # One line, always last: a worker error names the file with its full traceback.
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nrl plugins --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # after BrokenPipeError, an OSError too
        import errno

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A full disk (or quota) is the user's to fix: one line naming the file, not a traceback.
        where = f" writing {exc.filename}" if exc.filename else ""
        print(
            f"error: {exc.strerror}{where}; free space there, or point logger.log_dir and "
            "checkpointing.checkpoint_dir at another disk",
            file=sys.stderr,
        )
        return 1
    except SystemExit as exc:
        # A SIGTERM that reached the cluster's handler inside one of Ray's waits comes back
        # from Ray as SystemExit(1) (see nrl_core.distributed.cluster.received_signal).
        cluster = sys.modules.get("nrl_core.distributed.cluster")
        signum = cluster.received_signal() if cluster is not None else None
        if signum is not None and exc.code not in (None, 0):
            return 128 + signum
        raise


if __name__ == "__main__":
    sys.exit(main())
