"""Datasets: JSONL files and their validation split, the shipped word problems, and the hub
datasets' row mapping on rows built here in each dataset's hub format."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from nrl_math_env import word_problems
from nrl_math_env.config import (
    MATH_PROMPT,
    HFDatasetConfig,
    JsonlDataConfig,
    WordProblemsDataConfig,
)
from nrl_math_env.loaders import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    WORD_PROBLEMS_FILE,
    DapoMath17kDataset,
    DataFileError,
    DatasetUnavailableError,
    GSM8KDataset,
    JsonlDataset,
    Math500Dataset,
    OpenMathInstruct2Dataset,
    WordProblemsDataset,
)

from nrl_core.config.loader import resolve_config
from nrl_core.config.schema import DataConfig, GRPOConfig
from nrl_core.interfaces import ComponentContext
from nrl_core.plugins import PluginHost

EXAMPLE = Path(__file__).parents[1] / "examples" / "guess_number_cpu.yaml"


def context(**data) -> ComponentContext:
    return ComponentContext(config=GRPOConfig(data=DataConfig(**data)))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_jsonl_held_out_validation_split(tmp_path):
    rows = [{"problem": f"What is {i}+1?", "answer": str(i + 1), "source": "t"} for i in range(20)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    dataset = JsonlDataset(JsonlDataConfig(path=path), context(val_fraction=0.25))
    train, val = dataset.load("train"), dataset.load("validation")
    assert (len(train), len(val)) == (15, 5)
    problems = [s.metadata["problem"] for s in train + val]
    assert sorted(problems) == sorted(r["problem"] for r in rows)  # a partition
    assert [s.metadata["problem"] for s in dataset.load("validation")] == problems[15:]  # stable
    sample = train[0]
    assert sample.messages == [
        {"role": "user", "content": MATH_PROMPT.replace("{problem}", sample.metadata["problem"])}
    ]
    assert sample.task == "math" and sample.metadata["source"] == "t"
    assert sample.answer == str(int(sample.metadata["problem"].split()[2].split("+")[0]) + 1)
    no_val = JsonlDataset(JsonlDataConfig(path=path), context(val_fraction=0.0))
    assert len(no_val.load("train")) == 20
    with pytest.raises(KeyError):
        no_val.load("validation")


def test_jsonl_validation_file_custom_fields_and_data_dataset_path(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}])
    val = write_jsonl(tmp_path / "v.jsonl", [{"q": "3+3", "a": 6}])
    options = JsonlDataConfig(
        problem_field="q", answer_field="a", prompt_template="Q: {problem} \\boxed{}", task="t"
    )
    dataset = JsonlDataset(options, context(dataset=train, val_dataset=val))
    assert [s.answer for s in dataset.load("train")] == ["2", "4"]
    (sample,) = dataset.load("validation")
    assert (
        sample.messages[0]["content"] == "Q: 3+3 \\boxed{}"
        and sample.answer == "6"
        and sample.task == "t"
    )


def test_jsonl_errors_say_what_to_fix(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        JsonlDataset(JsonlDataConfig(path=str(tmp_path / "nope.jsonl")), context()).load("train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": 1}\n{oops\n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: not valid JSON"):
        JsonlDataset(JsonlDataConfig(path=str(bad)), context()).load("train")
    missing = write_jsonl(tmp_path / "m.jsonl", [{"question": "x", "answer": 1}])
    with pytest.raises(DataFileError, match="no field 'problem'"):
        JsonlDataset(JsonlDataConfig(path=missing), context()).load("train")
    with pytest.raises(DataFileError, match=r"data\.jsonl\.path"):
        JsonlDataset(JsonlDataConfig(), context(dataset="jsonl")).load("train")


def test_shipped_word_problems_match_their_generator():
    shipped = [json.loads(line) for line in WORD_PROBLEMS_FILE.read_text().splitlines()]
    assert shipped == word_problems.generate()
    dataset = WordProblemsDataset(WordProblemsDataConfig(), context(val_fraction=0.1))
    train, val = dataset.load("train"), dataset.load("validation")
    assert (len(train), len(val)) == (360, 40)
    assert all(s.answer.isdigit() and s.messages[0]["content"].isascii() for s in train + val)


def test_gsm8k_row_mapping(tmp_path):
    rows = [
        {"question": "Tom has 3 apples...", "answer": "He has 3+4=<<3+4=7>>7.\n#### 7"},
        {"question": "A farm sells...", "answer": "So 1,200 in all.\n#### 1,200"},
    ]
    dataset = GSM8KDataset(
        HFDatasetConfig(path=write_jsonl(tmp_path / "g.jsonl", rows)), context(val_fraction=0.5)
    )
    assert [dataset.to_sample(r).answer for r in rows] == ["7", "1200"]
    sample = dataset.to_sample(rows[0])
    assert sample.messages[0]["content"].startswith(
        "Tom has 3 apples...\n\nPlease reason step by step"
    )
    assert len(dataset.load("train")) == 1 and len(dataset.load("validation")) == 1


def test_math500_row_mapping_and_no_train_split():
    row = {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "solution": "...", "answer": "1",
           "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}  # fmt: skip
    sample = Math500Dataset(HFDatasetConfig(), context()).to_sample(row)
    assert sample.answer == "1" and sample.metadata["subject"] == "Algebra"
    assert sample.metadata["unique_id"] == "test/algebra/1.json"
    with pytest.raises(KeyError):
        Math500Dataset(HFDatasetConfig(), context()).load("train")


def test_openmathinstruct2_keeps_each_problem_once(tmp_path):
    rows = [
        {"problem": "Solve x+1=2.", "generated_solution": "x=1", "expected_answer": "1", "problem_source": "augmented_math"},
        {"problem": "Solve x+1=2.", "generated_solution": "so x is 1", "expected_answer": "1", "problem_source": "augmented_math"},
        {"problem": "Find 2^3.", "generated_solution": "8", "expected_answer": "8", "problem_source": "math"},
    ]  # fmt: skip
    options = HFDatasetConfig(path=write_jsonl(tmp_path / "o.jsonl", rows))
    samples = OpenMathInstruct2Dataset(options, context(val_fraction=0.0)).load("train")
    assert [(s.metadata["problem"], s.answer) for s in samples] == [
        ("Solve x+1=2.", "1"),
        ("Find 2^3.", "8"),
    ]
    assert samples[1].metadata["problem_source"] == "math"


def test_dapo_row_mapping_strips_its_instruction():
    problem = "Find the number of positive divisors of 12."
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "6", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1"},
    }
    sample = DapoMath17kDataset(HFDatasetConfig(prompt_template="{problem}"), context()).to_sample(
        row
    )
    assert sample.messages == [{"role": "user", "content": problem}] and sample.answer == "6"


@pytest.mark.skipif(
    importlib.util.find_spec("datasets") is not None, reason="datasets is installed"
)
def test_hub_dataset_without_the_datasets_library_says_how_to_fix():
    with pytest.raises(DatasetUnavailableError, match=r"nrl-math-env\[hf\].*data\.gsm8k\.path"):
        GSM8KDataset(HFDatasetConfig(), context()).load("train")


def test_plugin_registers_everything_and_the_example_config_resolves():
    registry = PluginHost.discover(selection=["math"]).registry()
    assert {s.name for s in registry if s.plugin == "math" and s.kind == "environment"} == {
        "math", "arithmetic", "guess_number"}  # fmt: skip
    assert {s.name for s in registry if s.plugin == "math" and s.kind == "dataset"} == {
        "arithmetic", "guess_number", "word_problems", "jsonl", "gsm8k", "math500",
        "openmathinstruct2", "dapo_math_17k"}  # fmt: skip
    for spec in registry:
        if spec.plugin == "math":
            assert spec.load() is not None and (spec.config is None or spec.load_config_class())
    config = resolve_config("grpo", EXAMPLE, registry=registry)
    assert config.env.name == "guess_number" and config.data.dataset == "guess_number"
    assert config.env.options_for().max_turns == config.grpo.max_rollout_turns
