"""``nrl slurm``: run nrl on a Slurm allocation through a Ray cluster started inside it.

The work is done by the batch script shipped in the package (``nrl_core/cluster_scripts/
nrl.sbatch``, docs/runtime.md "Slurm"); this module prints or writes it (``script``), submits
it after checking the run's config (``submit``), and holds the two steps the script asks of
Python: the run folder and GPUs the config names (``plan``), and the wait for every node to
join (``wait``). Import-light: Ray is imported by ``wait`` only.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from nrl_core.errors import ConfigError

SCRIPT_NAME = "nrl.sbatch"


def script_path() -> Path:
    """The shipped batch script (a file inside the installed package)."""
    return Path(str(resources.files("nrl_core") / "cluster_scripts" / SCRIPT_NAME))


def add_parser(subparsers: Any) -> None:
    """Add ``slurm`` and its ``script``/``submit``/``plan``/``wait`` subcommands."""
    slurm = subparsers.add_parser(
        "slurm",
        help="run on a Slurm allocation: a Ray cluster inside it, then `nrl run` against it",
        description="`nrl slurm submit --nodes 2 -- run grpo --config my.yaml` submits the "
        "shipped batch script (`nrl slurm script` prints it); see docs/runtime.md, Slurm.",
    )
    slurm.set_defaults(handler=lambda args: (slurm.print_help(), 0)[1])
    sub = slurm.add_subparsers(dest="slurm_command", metavar="COMMAND")

    script = sub.add_parser("script", help="print the batch script (or write it, or its path)")
    what = script.add_mutually_exclusive_group()
    what.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead")
    what.add_argument("--path", action="store_true", help="print the path of the installed script")
    script.set_defaults(handler=_script)

    submit = sub.add_parser(
        "submit",
        help="check the config, then sbatch the script: nrl slurm submit --nodes N -- run ...",
    )
    submit.add_argument("--nodes", type=int, default=1, help="nodes to allocate (>= 1)")
    submit.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs to ask of each node (default: the config's cluster.gpus_per_node, else none)",
    )
    submit.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to sbatch as is (repeatable): --sbatch-arg=--partition=batch",
    )
    submit.add_argument("nrl_args", nargs=argparse.REMAINDER, metavar="-- run ALGO ...")
    submit.set_defaults(handler=_submit)

    plan = sub.add_parser(
        "plan", help="(used by the script) the run folder and GPUs per node, as shell variables"
    )
    plan.add_argument("nrl_args", nargs=argparse.REMAINDER, metavar="-- run ALGO ...")
    plan.set_defaults(handler=_plan)

    wait = sub.add_parser(
        "wait", help="(used by the script) wait until the Ray cluster has every node and GPU"
    )
    wait.add_argument("--address", required=True, help="the Ray head, HOST:PORT")
    wait.add_argument("--nodes", type=int, required=True, help="nodes to wait for (>= 1)")
    wait.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each node must have")
    wait.add_argument("--timeout-s", type=float, default=600.0, help="give up after (seconds)")
    wait.add_argument("--logs", default=None, help="where the nodes' logs are (for the message)")
    wait.set_defaults(handler=_wait)


def _script(args: argparse.Namespace) -> int:
    path = script_path()
    if args.path:
        print(path)
    elif args.output:
        out = Path(args.output)
        if out.is_dir():
            raise ConfigError(f"--output {out} is a folder; name a file, e.g. {out}/nrl.sbatch")
        out.write_text(path.read_text())
        out.chmod(0o755)
        print(out)
    else:
        sys.stdout.write(path.read_text())
    return 0


def _nrl_args(raw: list[str]) -> list[str]:
    args = raw[1:] if raw[:1] == ["--"] else list(raw)
    if not args or args[0] != "run":
        raise ConfigError(
            "expected the nrl command to run after `--`, e.g. `-- run grpo --config my.yaml`"
        )
    return args


def _resolve_run(nrl_args: list[str]):
    """The resolved config of ``nrl run ...`` (exit 2 with one line when it is bad), as the
    script's run will see it: on the cluster the script starts."""
    from nrl_core.cli import _resolve, build_parser

    parsed, extra = build_parser().parse_known_args(nrl_args)
    parsed.overrides += [a for a in extra if "=" in a and not a.startswith("-")]
    extra = [a for a in extra if a not in parsed.overrides]
    if extra:
        raise ConfigError(f"nrl run: unrecognized arguments: {' '.join(extra)}")
    parsed.overrides += ["cluster.backend=ray", "cluster.address=slurm-head:6379"]
    parsed.quiet = True
    config, _ = _resolve(parsed)
    return config


def _run_dir(config) -> Path:
    return (Path(config.logger.log_dir) / config.logger.run_name).absolute()


def _plan(args: argparse.Namespace) -> int:
    config = _resolve_run(_nrl_args(args.nrl_args))
    gpus = config.cluster.gpus_per_node
    print(f"RUN_DIR={shlex.quote(str(_run_dir(config)))}")
    print(f"GPUS_PER_NODE={'' if gpus is None else gpus}")
    return 0


def _submit(args: argparse.Namespace) -> int:
    nrl_args = _nrl_args(args.nrl_args)
    if args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: a run needs at least 1 node")
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: give 0 or more")
    # The config first ("check the config, then sbatch"): a bad key is the user's to fix
    # wherever they are, and a machine without sbatch must not hide it.
    config = _resolve_run(nrl_args)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            "sbatch is not on PATH: run this on a Slurm login node, or write the script with "
            "`nrl slurm script -o nrl.sbatch` and submit it where Slurm is"
        )
    gpus = args.gpus_per_node
    if gpus is None:
        gpus = config.cluster.gpus_per_node
    command = [sbatch, "--parsable", f"--nodes={args.nodes}"]
    if gpus:
        command.append(f"--gpus-per-node={gpus}")
    command += [*args.sbatch_arg, str(script_path()), *nrl_args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: sbatch refused the job: {detail}", file=sys.stderr)
        return 1
    job = result.stdout.strip().split(";")[0]
    print(f"submitted job {job}: {args.nodes} node(s); run folder {_run_dir(config)}")
    return 0


def cluster_shape() -> tuple[int, int, list[float]]:
    """(alive nodes, their GPUs in all, each alive node's GPUs) of the Ray cluster this process
    joined."""
    import ray

    alive = [node for node in ray.nodes() if node.get("Alive")]
    gpus = [float(node.get("Resources", {}).get("GPU", 0)) for node in alive]
    return len(alive), int(sum(gpus)), gpus


def _wait(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: a cluster has at least 1 node")
    if args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: give 0 or more")
    import ray

    import nrl_core.distributed  # noqa: F401  (Ray's uv-run hook off before ray.init)

    deadline = time.monotonic() + args.timeout_s
    connected, last_error = False, None
    nodes, gpus_total, per_node = 0, 0, []
    while True:
        if not connected:
            try:
                ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
                connected = True
            except Exception as exc:  # the head is not answering yet: try again until the end
                last_error = exc
        if connected:
            nodes, gpus_total, per_node = cluster_shape()
            enough_gpus = sum(1 for g in per_node if g >= args.gpus_per_node) >= args.nodes
            if nodes >= args.nodes and enough_gpus:
                ray.shutdown()
                print(
                    f"Ray cluster at {args.address}: {nodes} node(s), {gpus_total} GPU(s)",
                    file=sys.stderr,
                )
                return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    where = f"; see each node's `ray start` output in {args.logs}" if args.logs else ""
    if not connected:
        print(
            f"error: no Ray head answered at {args.address} within {args.timeout_s:g} s "
            f"({last_error}){where}",
            file=sys.stderr,
        )
    else:
        ray.shutdown()
        print(
            f"error: the Ray cluster at {args.address} has {nodes} of {args.nodes} node(s) "
            f"and {gpus_total} of {args.nodes * args.gpus_per_node} GPU(s) after "
            f"{args.timeout_s:g} s (NRL_RAY_WAIT_S){where}",
            file=sys.stderr,
        )
    return 1
