"""Registers this plugin's environment and dataset with nrl (entry point ``nrl.plugins``).

Targets are ``"module:attr"`` strings: nrl imports this file when it lists plugins, and the
environment module only inside the environment's Ray actor.
"""

from nrl_core import hookimpl


@hookimpl
def nrl_register_environments(register):
    """The ``{{ cookiecutter.__component }}`` environment (``env.name={{ cookiecutter.__component }}``)."""
    register(
        "{{ cookiecutter.__component }}",
        "{{ cookiecutter.__module }}.environment:{{ cookiecutter.__class_prefix }}Environment",
        config="{{ cookiecutter.__module }}.config:{{ cookiecutter.__class_prefix }}EnvConfig",
        extras=["env"],
        description="reward 1 for the reversed word, partial credit per right character",
    )


@hookimpl
def nrl_register_datasets(register):
    """The ``{{ cookiecutter.__component }}`` dataset (``data.dataset={{ cookiecutter.__component }}``)."""
    register(
        "{{ cookiecutter.__component }}",
        "{{ cookiecutter.__module }}.dataset:{{ cookiecutter.__class_prefix }}Dataset",
        config="{{ cookiecutter.__module }}.config:{{ cookiecutter.__class_prefix }}DataConfig",
        description="random lower-case words to reverse, generated from the seed",
    )
