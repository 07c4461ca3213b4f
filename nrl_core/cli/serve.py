"""``nrl serve [--config FILE] [--host H] [--port P] [--api-key K | --no-api-key] [KEY=VALUE...]``:
a model behind the OpenAI-compatible endpoint (:mod:`nrl_core.serving`).

A host other than loopback (``--host 0.0.0.0``, ``server.host``) serves the network: it is
refused without an API key (``--api-key``, ``server.api_key``) unless ``--no-api-key`` says an
open endpoint is meant.

It starts what a training run would for generation (the cluster, the policy ranks for
``generation.backend=torch``, or the engines of vLLM / SGLang, loaded with ``policy.model_name``)
and serves until Ctrl-C or SIGTERM. Imports stay lazy: ``nrl --help`` must not import torch.
"""

from __future__ import annotations

import argparse
from typing import Any

_EPILOG = """\
examples:
  nrl serve                                  the tiny CPU model on http://127.0.0.1:8000/v1
  nrl serve --port 0                         any free port (printed)
  nrl serve policy.model_name=path/to/hf_folder generation.backend=vllm --api-key secret
  nrl serve --host 0.0.0.0 --api-key secret  on the network (a key, or --no-api-key, is needed)
"""


def add_parser(subparsers: Any) -> None:
    """Register ``nrl serve`` on the CLI's sub-command parsers."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve policy.model_name with generation.backend behind /v1/chat/completions, "
            "/v1/models, /tokenize and /inference/v1/generate, bound to 127.0.0.1 unless "
            "--host says otherwise."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: embedded)")
    parser.add_argument("--host", help="address to bind (server.host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (server.port; 0: a free one)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require Authorization: Bearer KEY (server.api_key)")
    keys.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches it may use it)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. server.port=9000"
    )
    from nrl_core.cli import _plugin_option

    _plugin_option(parser)
    parser.set_defaults(handler=_cmd_serve)


def resolve_serve_config(args: argparse.Namespace, registry: Any) -> Any:
    """Class defaults < the embedded recipe (without ``--config``) < ``--config`` <
    ``--host/--port/--api-key`` < overrides."""
    from nrl_core.algorithms.recipes import default_recipe
    from nrl_core.config.loader import ConfigConverter, apply_overrides, load_config_file
    from nrl_core.config.schema import ServeConfig

    data: dict[str, Any] = load_config_file(args.config) if args.config else default_recipe("serve")
    flags = [
        f"server.{key}={value}"
        for key, value in (("host", args.host), ("port", args.port), ("api_key", args.api_key))
        if value is not None
    ]
    data = apply_overrides(data, [*flags, *args.overrides])
    return ConfigConverter(registry).structure(data, ServeConfig)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ::1).
    A name other than ``localhost`` is not resolved: it may name any interface."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(server: Any, *, open_on_purpose: bool) -> None:
    """Refuse to serve the network without an API key: a host other than loopback with no
    ``server.api_key`` lets anyone who reaches the port generate with the model, so it needs
    ``--no-api-key`` to say that is meant."""
    from nrl_core.errors import ConfigError

    if server.api_key or open_on_purpose or is_loopback(server.host):
        return
    raise ConfigError(
        f"server.host={server.host} serves the network and no API key is set: give --api-key "
        "KEY (server.api_key; clients send Authorization: Bearer KEY), or --no-api-key to "
        "serve it open on purpose"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from nrl_core.cli import _host, _warn_broken

    args.quiet = bool(getattr(args, "quiet", False))
    host = _host(args)
    _warn_broken(host, args)
    registry = host.registry()
    config = resolve_serve_config(args, registry)
    from nrl_core.preflight import check_tool_parser

    check_tool_parser(config, registry)  # before anything heavy starts
    check_exposure(config.server, open_on_purpose=bool(getattr(args, "no_api_key", False)))

    from nrl_core.algorithms.runtime import RunSession

    session = RunSession(config, registry, algorithm="serve", console=Console(quiet=args.quiet))
    failed = False
    try:
        server = session.start_server_only()
        print(f"serving {server.model_id} at {server.base_url}", flush=True)
        server.serve_forever()
    except BaseException as exc:
        failed = not (isinstance(exc, SystemExit) and exc.code in (0, None))
        raise
    finally:
        session.close(failed=failed)
    return 0
