"""The generated hook and configuration references, and the hook signatures the docs show."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import attrs
import pytest

from nrl_core.config.schema import ALGORITHM_CONFIGS
from nrl_core.plugins import HOOK_KINDS
from nrl_core.registry import Register

REPO = Path(__file__).resolve().parents[2]


def _load_generator():
    # docs/ is not a package; load the generator the way MkDocs does, from its path.
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs/gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def test_every_hook_is_documented():
    specs = gen.hook_specs()
    assert set(specs) == set(HOOK_KINDS), "hookspecs and the plugin host disagree on the hooks"
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc.split()) >= 20, f"{name} needs a docstring saying what to register"
        assert "nrl_core.interfaces." in doc, f"{name} must name the interface its targets honour"
        assert f"``{gen.SECTION_OF_KIND[HOOK_KINDS[name]]}." in doc, (
            f"{name} must say which config key selects it"
        )


def test_hook_reference_shows_the_code_signatures():
    page = gen.hook_reference()
    for name, fn in gen.hook_specs().items():
        params = list(inspect.signature(fn).parameters)
        shown = re.search(rf"^def {name}\((.*)\)", page, re.M)
        assert shown, f"{name} is missing from the hook reference"
        assert [p.split(":")[0].strip() for p in shown.group(1).split(",")] == params
        assert f"### `{name}`" in page
    register_params = [p for p in inspect.signature(Register.__call__).parameters if p != "self"]
    shown = re.search(r"^def register\((.*)\)", page, re.M).group(1)
    assert [p.split(":")[0].strip("* ") for p in shown.split(", ") if p != "*"] == register_params
    for param in register_params:
        assert f"`{'**' if param == 'metadata' else ''}{param}`:" in page, (
            f"Register argument {param!r} is undocumented"
        )


def _documented_hook_definitions():
    """Every ``def nrl_register_*(...)`` shown in the docs, the README and the template."""
    sources = [*(REPO / "docs").glob("*.md"), REPO / "README.md"]
    sources += (REPO / "plugin_template").rglob("plugin.py")
    for path in sources:
        for match in re.finditer(r"def (nrl_\w+)\(([^)]*)\)", path.read_text()):
            yield path.relative_to(REPO), match.group(1), match.group(2)


def test_documented_hook_signatures_match_the_code():
    found = list(_documented_hook_definitions())
    assert found, "the docs show no hook implementation"
    specs = gen.hook_specs()
    for path, name, args in found:
        assert name in specs, f"{path}: {name} is not an nrl hook"
        names = [a.split(":")[0].strip() for a in args.split(",") if a.strip()]
        # pluggy passes implementations only the arguments they name: a subset is valid.
        assert set(names) <= set(inspect.signature(specs[name]).parameters), (
            f"{path}: {name}({args}) does not match {gen.hook_signature(specs[name])}"
        )


def _all_config_classes(cls, seen):
    if cls in seen:
        return
    seen.add(cls)
    for field in attrs.fields(cls):
        default = gen._default(field)
        if attrs.has(type(default)):
            _all_config_classes(type(default), seen)


def test_every_config_option_is_documented(nrl_registry):
    classes: set[type] = set()
    for cls in ALGORITHM_CONFIGS.values():
        _all_config_classes(cls, classes)
    for spec in nrl_registry:
        if spec.config is not None:
            _all_config_classes(spec.load_config_class(), classes)
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{f.name}"
        for cls in classes
        for f in attrs.fields(cls)
        if not f.metadata.get("doc")
    ]
    assert not missing, f"config fields without option(default, doc): {missing}"


def test_config_reference_covers_core_and_plugin_options(nrl_registry):
    page = gen.config_reference(nrl_registry)
    for key in ("policy.optimizer.lr", "grpo.num_generations_per_prompt", "env.name", "seed"):
        assert f"| `{key}` |" in page, key
    for spec in nrl_registry:
        if spec.config is not None:
            section = f"{gen.SECTION_OF_KIND[spec.kind]}.{spec.name}"
            assert f"### `{section}`" in page
            for field in attrs.fields(spec.load_config_class()):
                assert f"| `{section}.{field.name}` |" in page


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    import subprocess
    import sys

    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    hooks = (tmp_path / "site/hooks/index.html").read_text()
    assert "nrl_register_environments" in hooks and "nrl:hook-reference" not in hooks
    config = (tmp_path / "site/configuration/index.html").read_text()
    assert "policy.optimizer.lr" in config and "nrl:config-reference" not in config


def _row(page, key):
    match = re.search(rf"^\| `{re.escape(key)}` \|(.*)$", page, re.M)
    assert match, f"{key} is missing from the configuration reference"
    return [cell.strip() for cell in match.group(1).split(" | ")]


def test_config_reference_shows_each_valid_range(nrl_registry):
    page = gen.config_reference(nrl_registry)
    assert "| key | type | default | valid | description |" in page
    expected = {
        "policy.optimizer.lr": "> 0",
        "generation.top_p": "in (0, 1]",
        "data.val_fraction": "in [0, 1)",
        "policy.precision": "one of `float32`, `bfloat16`",
        "policy.micro_batch_token_budget": ">= 1 or null",
        "policy.sequence_packing": "`auto`, `true` or `false`",
        "grpo.num_generations_per_prompt": ">= 2",
        "env.step_timeout_s": "> 0",
        "policy.backend": "a registered policy",
        "data.dataset": "a registered dataset or a `.jsonl` path",
        "loss.clipped_pg.kl_estimator": "one of `k1`, `k2`, `k3`",
        "generation.vllm.sleep_level": "one of `1`, `2`",
        "policy.dtensor.lora_dropout": "in [0, 1)",
    }
    for key, valid in expected.items():
        assert _row(page, key)[2] == valid, key
    # Every numeric key says its range (the validators behind it are tested in tests/config).
    for match in re.finditer(r"^\| `([\w.]+)` \| `(int|float)[^`]*` \|(.*)$", page, re.M):
        assert match.group(3).split(" | ")[1].strip(), f"{match.group(1)} shows no valid range"


WORKSPACE_PLUGINS = {"core", "dtensor", "gym", "math", "megatron", "sglang", "vllm"}


def test_committed_references_are_fresh():
    """docs/hooks.md and docs/configuration.md hold the generated references (readable in the
    repository, not only on the built site); they must equal what the code generates now.
    Fix: `uv run python docs/gen_reference.py --write`."""
    from nrl_core.plugins import PluginHost

    loaded = {info.name for info in PluginHost.discover().plugins if info.status == "ok"}
    if loaded != WORKSPACE_PLUGINS:
        pytest.skip(
            f"the committed reference documents every workspace plugin; this venv loads "
            f"{sorted(loaded)} (the dev environment has them all)"
        )
    for name, placeholder in gen.PAGES.items():
        page = (REPO / "docs" / name).read_text()
        assert gen.END_MARK in page, f"docs/{name} has no generated block"
        assert gen.fill(page, placeholder, gen.generated(placeholder)) == page, (
            f"docs/{name} is stale: run `uv run python docs/gen_reference.py --write`"
        )


def test_fill_replaces_only_the_generated_block():
    page = f"# Title\n\nintro\n\n{gen.CONFIG_PLACEHOLDER}\n\nold body\n\n{gen.END_MARK}\n\nafter\n"
    new = gen.fill(page, gen.CONFIG_PLACEHOLDER, "new body")
    assert (
        new
        == f"# Title\n\nintro\n\n{gen.CONFIG_PLACEHOLDER}\n\nnew body\n\n{gen.END_MARK}\nafter\n"
    )
    assert gen.fill(new, gen.CONFIG_PLACEHOLDER, "new body") == new
    # A bare placeholder (as the pages had before the blocks were committed) gains the block.
    bare = gen.fill(f"intro\n\n{gen.CONFIG_PLACEHOLDER}\n", gen.CONFIG_PLACEHOLDER, "body")
    assert bare == f"intro\n\n{gen.CONFIG_PLACEHOLDER}\n\nbody\n\n{gen.END_MARK}\n"
