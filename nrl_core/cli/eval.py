"""``nrl eval [--config FILE] [KEY=VALUE...]``: accuracy and pass@k of a model on a dataset.

The model is a Hugging Face name or folder (``policy.model_name``) or an nrl checkpoint
(``eval.checkpoint``, a ``step_N`` folder written by ``nrl run``). See
:mod:`nrl_core.algorithms.evaluate` for what is measured; without ``--config`` the embedded
recipe evaluates the tiny model on the shipped ``arithmetic`` validation set.

Imports stay lazy: ``nrl --help`` must not import torch, ray or transformers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

_EPILOG = """\
examples:
  nrl eval                                           the CPU demo: tiny model, arithmetic
  nrl eval policy.model_name=Qwen/Qwen2.5-0.5B-Instruct --config my_eval.yaml
  nrl eval eval.checkpoint=results/grpo-arithmetic/checkpoints   its newest step_N
  nrl eval eval.num_samples=8 eval.pass_k=[1,4,8] generation.temperature=0.7
"""


def add_parser(subparsers: Any) -> None:
    """Register ``nrl eval`` on the CLI's sub-command parsers."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model or checkpoint: accuracy, pass@k, response length",
        description=(
            "Sample eval.num_samples responses per validation problem of data.dataset, score "
            "them with env.name, print accuracy, pass@k and the mean response length, and "
            "write them to eval.json (eval.output, default <logger.log_dir>/<logger.run_name>/"
            "eval.json)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML config (default: the embedded recipe)"
    )
    parser.add_argument(
        "--show-config",
        action="store_true",
        help="print the resolved config as YAML and exit",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. eval.num_samples=8 policy.model_name=path/to/model",
    )
    from nrl_core.cli import _plugin_option

    _plugin_option(parser)
    parser.set_defaults(handler=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from nrl_core.cli import _host, _warn_broken

    args.quiet = bool(getattr(args, "quiet", False))
    args.verbose = bool(getattr(args, "verbose", False))
    host = _host(args)
    _warn_broken(host, args)
    registry = host.registry()

    from nrl_core.algorithms.recipes import resolve_eval_config

    config = resolve_eval_config(args.config, args.overrides, registry)
    if args.show_config:
        from nrl_core.config.loader import dump_config

        sys.stdout.write(dump_config(config, registry))
        return 0
    # Only now: the evaluation's module imports torch (seconds), and config errors above are
    # reported without it.
    from nrl_core.algorithms.evaluate import evaluate

    record = evaluate(config, registry, verbose=args.verbose, quiet=args.quiet)
    if not args.quiet:
        print(f"wrote {record['path']}")
    return 0
