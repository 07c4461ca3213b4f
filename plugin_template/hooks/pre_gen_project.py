"""Refuse names that cannot become a distribution, an import package and a component name.

Cookiecutter renders this file with the computed names before it writes anything, so a bad
``name`` fails here with a clear message instead of producing a broken project.
"""

import re
import sys

NAME = "{{ cookiecutter.name }}"
MODULE = "{{ cookiecutter.__module }}"
COMPONENT = "{{ cookiecutter.__component }}"

# The registry's rule for component names (nrl_core.registry): users write them in configs.
if not re.fullmatch(r"[a-z][a-z0-9_]*", COMPONENT) or not MODULE.isidentifier():
    sys.exit(
        f"error: plugin name {NAME!r} gives the component name {COMPONENT!r}; use letters, "
        "digits, spaces or dashes, starting with a letter (e.g. 'Reverse Words')"
    )
