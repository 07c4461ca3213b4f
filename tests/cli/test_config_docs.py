"""`nrl config show --docs ALGO` and `nrl run ALGO --help`: every option can be looked up from
the command line, with its description and valid range (issue 39: `run grpo --help` listed
no option and `config show` printed bare YAML)."""

from __future__ import annotations

import re

import attrs
import pytest
import yaml

from nrl_core.cli import ALGORITHMS, main
from nrl_core.config.schema import ALGORITHM_CONFIGS


def _out(capsys, *args: str) -> str:
    code = main(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_docs_is_the_same_config_with_every_option_described(capsys, algorithm):
    plain = _out(capsys, "config", "show", algorithm)
    documented = _out(capsys, "config", "show", "--docs", algorithm)
    # Still the same YAML, loadable as a config file: the descriptions are comments.
    assert yaml.safe_load(documented) == yaml.safe_load(plain)
    lines = documented.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#") or not line.strip():
            continue
        assert lines[i - 1].lstrip().startswith("#"), f"{line.strip()!r} has no description"
        assert len(line) <= 100 or ":" in line, line


def test_docs_shows_ranges_defaults_and_component_options(capsys):
    out = _out(capsys, "config", "show", "--docs", "grpo", "grpo.max_num_steps=7")
    block = re.search(r"((?:^\s*#.*\n)+)\s*max_num_steps: 7\n", out, re.M)
    assert block, out
    comment = " ".join(part.strip().lstrip("# ") for part in block.group(1).splitlines())
    assert comment == "Training steps. [int; >= 0; default 100]"  # type, range, class default
    assert "lr: 0.0003" in out and "> 0" in out
    # The selected components' own options are documented by their plugin's config class.
    assert "# options of policy 'dtensor' (plugin dtensor)" in out
    assert re.search(r"^    # .*\n    tensor_parallel_size: 1$", out, re.M)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_run_help_lists_the_sections_and_how_to_see_every_option(capsys, algorithm):
    with pytest.raises(SystemExit) as exc:
        main(["run", algorithm, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for field in attrs.fields(ALGORITHM_CONFIGS[algorithm]):
        assert re.search(rf"^  {field.metadata.get('key', field.name)}\s+\S", out, re.M), field.name
    assert f"nrl config show --docs {algorithm}" in out
    assert "docs/configuration.md" in out


def test_run_help_without_an_algorithm_says_where_the_sections_are(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "`nrl run ALGO --help` lists ALGO's config sections" in capsys.readouterr().out
