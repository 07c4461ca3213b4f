"""``nrl new-plugin``: generate an environment plugin project from nrl's cookiecutter template.

Non-interactive: every template variable has a command-line option. The computed names (the
distribution ``nrl-<slug>``, the package ``nrl_<slug>``, the component ``<slug>``) are derived by
the template itself, so ``nrl new-plugin`` and ``cookiecutter plugin_template`` agree.
Cookiecutter is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nrl_core.errors import NrlError

TEMPLATE_ENV_VAR = "NRL_PLUGIN_TEMPLATE"


class TemplateError(NrlError):
    """The template is missing, cookiecutter is not installed, or the name is unusable."""


def add_parser(subparsers: Any) -> None:
    """Add ``new-plugin`` to the ``nrl`` sub-commands."""
    parser = subparsers.add_parser(
        "new-plugin",
        help="generate an environment plugin project (pyproject, environment, dataset, tests)",
        description="Generate nrl-<name>/ from nrl's plugin template: an environment and a "
        "dataset registered through the nrl.plugins entry point, conformance tests, an example "
        "config, a README and a CI workflow.",
    )
    parser.add_argument("--name", required=True, help='the plugin\'s name, e.g. "Reverse Words"')
    parser.add_argument("--description", help="one line for the package metadata and README")
    parser.add_argument("--author", help="author name")
    parser.add_argument("--author-email", help="author e-mail")
    parser.add_argument(
        "--output-dir", default=".", metavar="DIR", help="where nrl-<name>/ is created (default .)"
    )
    parser.add_argument(
        "--template",
        metavar="PATH",
        help=f"template folder or URL (default: ${TEMPLATE_ENV_VAR}, else the checkout's "
        "plugin_template/)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing project")
    parser.set_defaults(handler=_handle)


def default_template() -> str:
    """The plugin template: ``$NRL_PLUGIN_TEMPLATE``, else the copy inside the installed
    package (a wheel carries it as ``nrl_core/plugin_template``), else the checkout's
    ``plugin_template/`` (an editable install)."""
    import os

    if os.environ.get(TEMPLATE_ENV_VAR):
        return os.environ[TEMPLATE_ENV_VAR]
    here = Path(__file__).resolve()
    candidates = [here.parents[1] / "plugin_template", here.parents[2] / "plugin_template"]
    for path in candidates:
        if (path / "cookiecutter.json").is_file():
            return str(path)
    raise TemplateError(
        f"the plugin template is missing (looked in {candidates[0]} and {candidates[1]}); "
        f"reinstall nrl-core, or pass --template PATH or set {TEMPLATE_ENV_VAR}"
    )


def generate(
    name: str,
    output_dir: str | Path = ".",
    *,
    template: str | None = None,
    force: bool = False,
    **context: str,
) -> Path:
    """Bake the template for ``name``; returns the created project folder.

    ``context`` adds other template variables (``description``, ``author``, ``author_email``).
    """
    try:
        from cookiecutter.exceptions import CookiecutterException, FailedHookException
        from cookiecutter.main import cookiecutter
    except ImportError:
        # A dependency of nrl-core; missing only from a broken or partial install.
        raise TemplateError("nrl new-plugin needs cookiecutter: pip install cookiecutter") from None
    import logging

    # Cookiecutter logs a traceback when the template's hook rejects a name; the hook's own
    # message (on stderr) says everything, and TemplateError below carries the rest.
    logging.getLogger("cookiecutter").setLevel(logging.CRITICAL)
    extra = {"name": name, **{k: v for k, v in context.items() if v is not None}}
    try:
        project = cookiecutter(
            template or default_template(),
            no_input=True,
            extra_context=extra,
            output_dir=str(output_dir),
            overwrite_if_exists=force,
        )
    except FailedHookException:
        # The template's pre-generation hook printed why the name is unusable.
        raise TemplateError(
            f"cannot make a plugin named {name!r} (see the message above)"
        ) from None
    except CookiecutterException as exc:
        raise TemplateError(f"the plugin template failed: {exc}") from None
    return Path(project)


def _handle(args: argparse.Namespace) -> int:
    project = generate(
        args.name,
        args.output_dir,
        template=args.template,
        force=args.force,
        description=args.description,
        author=args.author,
        author_email=args.author_email,
    )
    print(f"created {project}")
    # The `test` extra brings pytest: a bare `pip install -e` would leave it out.
    print(f"next: {install_command()} -e '{project}[test]'  &&  cd {project}  &&  python -m pytest")
    return 0


def install_command() -> str:
    """What installs into this interpreter's environment: ``python -m pip install`` where pip
    is in it, else ``uv pip install`` (a uv venv has no pip, and a bare ``pip`` on the PATH
    would then be the system's, installing somewhere else)."""
    import importlib.util

    return "python -m pip install" if importlib.util.find_spec("pip") else "uv pip install"
