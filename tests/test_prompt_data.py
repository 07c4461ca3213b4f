"""The core's ``prompts`` dataset: your own GRPO prompts from JSONL or Hugging Face, extra
fields handed to the environment (nrl_core/prompt_data.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nrl_core.config.schema import DataConfig, TaskConfig
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.prompt_data import PromptDataConfig, PromptDataError, PromptDataset
from nrl_core.testing.conformance import DatasetConformance

FIXTURES = Path(__file__).resolve().parent / "fixtures"

ROWS = [
    {"prompt": "Say cat", "answer": "cat", "keyword": "cat", "bonus": 0.0, "id": 1, "tags": ["a"]},
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say dog"},
        ],
        "answer": "dog",
        "keyword": "dog",
        "bonus": 0.25,
        "id": 2,
        "info": {"lang": "en", "level": [1, 2]},
    },
    {"prompt": "Say sun", "keyword": "sun", "bonus": 0.5, "id": 3},  # no answer
    {"prompt": "Say sky", "answer": 7, "keyword": "sky", "bonus": 1.0, "id": 4, "note": None},
]
VAL_ROWS = [
    {"prompt": "Say red", "answer": "red", "keyword": "red", "bonus": 0.75, "id": 101},
    {"prompt": "Say sea", "answer": "sea", "keyword": "sea", "bonus": 0.25, "id": 102},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path: Path, split: str = "train", context=None, **options):
    return PromptDataset(PromptDataConfig(path=str(path), **options), context).load(split)


# -- rows to samples ---------------------------------------------------------------------------


def test_each_row_becomes_a_sample_with_its_extra_fields_as_metadata(tmp_path):
    samples = load(write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert [s.messages for s in samples] == [
        [{"role": "user", "content": "Say cat"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say dog"}],
        [{"role": "user", "content": "Say sun"}],
        [{"role": "user", "content": "Say sky"}],
    ]
    # The answer keeps its JSON type; a row without one has None.
    assert [s.answer for s in samples] == ["cat", "dog", None, 7]
    assert {s.task for s in samples} == {"prompts"}
    assert samples[0].metadata == {"keyword": "cat", "bonus": 0.0, "id": 1, "tags": ["a"]}
    assert samples[1].metadata == {
        "keyword": "dog",
        "bonus": 0.25,
        "id": 2,
        "info": {"lang": "en", "level": [1, 2]},
    }
    assert samples[3].metadata["note"] is None  # a null column is still handed over


def test_what_the_environment_gets_is_the_row_plus_answer_and_task(tmp_path):
    """The core's rollout builds the environment's metadata from the sample
    (:func:`start_episodes`): the extra fields under their own names, answer and task."""
    from nrl_core.algorithms.rollout import ChatCodec, start_episodes
    from nrl_core.testing.tiny import build_tokenizer

    samples = load(write_jsonl(tmp_path / "p.jsonl", ROWS), task="keywords")
    episodes = start_episodes(samples[:2], ChatCodec(build_tokenizer()), repeats=2)
    assert [e.metadata for e in episodes[:3:2]] == [
        {"keyword": "cat", "bonus": 0.0, "id": 1, "tags": ["a"], "answer": "cat", "task": "keywords"},
        {
            "keyword": "dog",
            "bonus": 0.25,
            "id": 2,
            "info": {"lang": "en", "level": [1, 2]},
            "answer": "dog",
            "task": "keywords",
        },
    ]  # fmt: skip


def test_fields_are_mapped_by_the_options(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [{"question": "2+2?", "solution": "4", "source": "s1"}],
    )
    (sample,) = load(path, prompt_field="question", answer_field="solution", task="qa")
    assert sample.messages == [{"role": "user", "content": "2+2?"}]
    assert (sample.answer, sample.task, sample.metadata) == ("4", "qa", {"source": "s1"})
    # answer_field null: the rows have no answer; every field but the prompt is metadata.
    (sample,) = load(path, prompt_field="question", answer_field=None)
    assert sample.answer is None
    assert sample.metadata == {"solution": "4", "source": "s1"}
    # exclude_fields keeps columns away from the environment.
    (sample,) = load(path, prompt_field="question", exclude_fields=["source", "absent"])
    assert sample.metadata == {"solution": "4"}


def test_the_template_wraps_text_prompts_only_and_keeps_other_braces(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x^2=4"}])
    template = "Solve: {prompt}\nPut the result in \\boxed{}."
    (sample,) = load(path, prompt_template=template)
    assert sample.messages == [
        {"role": "user", "content": "Solve: x^2=4\nPut the result in \\boxed{}."}
    ]
    (sample,) = load(path)  # no template: the prompt alone, nothing added
    assert sample.messages == [{"role": "user", "content": "x^2=4"}]
    with pytest.raises(ValueError, match=r"must be a string containing `\{prompt\}`"):
        PromptDataConfig(prompt_template="Solve it")


def test_message_prompts_are_used_as_given_with_sharegpt_roles_mapped(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "prompt": [
                    {"role": "system", "content": "S", "weight": 1},
                    {"role": "human", "content": "Q1"},
                    {"role": "gpt", "content": "A1"},
                    {"role": "user", "content": "Q2"},
                ]
            }
        ],
    )
    (sample,) = load(path)
    assert sample.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


BAD_ROWS = [
    # (the bad row, options, the error after "b.jsonl:2: ")
    ({"question": "hi"}, {}, r"no field 'prompt' \(fields: question\); set data\.prompts\.prompt_field to the field holding the prompt"),
    ({"prompt": 3}, {}, r"field 'prompt' must be text or a list of chat messages .*, got a number \(3\); set data\.prompts\.prompt_field"),
    ({"prompt": {"text": "hi"}}, {}, r"field 'prompt' must be text or a list of chat messages .*, got an object"),
    ({"prompt": "  "}, {}, r"field 'prompt' is empty; every row needs a prompt"),
    ({"prompt": []}, {}, r"field 'prompt' is an empty list; a prompt needs a message"),
    ({"prompt": ["hi"]}, {}, r"prompt\[0\] must be a message \(.*\), got a string"),
    ({"prompt": [{"role": "user"}]}, {}, r"prompt\[0\] needs text `role` and `content`, got role 'user' and content None"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, {}, r"prompt\[1\] has role 'tool'; a prompt's roles are system, user, assistant"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, {}, r"field 'prompt' ends with an assistant message"),
    ({"prompt": [{"role": "user", "content": "a"}]}, {"prompt_template": "Q: {prompt}"}, r"field 'prompt' holds a list of messages, which is used as is; data\.prompts\.prompt_template applies to text prompts only: unset it"),
    ({"prompt": "hi"}, {"require_answer": True}, r"field 'answer' is missing or null and data\.prompts\.require_answer is set; add the answer, set data\.prompts\.answer_field"),
    ({"prompt": "hi", "answer": None}, {"require_answer": True}, r"field 'answer' is missing or null"),
    ({"prompt": "hi", "task": "t"}, {}, r"field 'task' would be overwritten \(the environment gets metadata\['task'\] = the sample's task\); rename it, or add it to data\.prompts\.exclude_fields$"),
    ({"prompt": "hi", "answer": "1"}, {"answer_field": "gold"}, r"field 'answer' would be overwritten .* add it to data\.prompts\.exclude_fields \(or set data\.prompts\.answer_field=answer\)$"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "options", "message"), BAD_ROWS)
def test_a_bad_row_is_one_line_naming_the_row_the_field_and_the_option(
    tmp_path, row, options, message
):
    good = {"prompt": "fine", options.get("answer_field", "answer"): "1"}
    path = write_jsonl(tmp_path / "b.jsonl", [good, row])
    with pytest.raises(PromptDataError) as error:
        load(path, **options)
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith(f"{path}:2: "), text
    assert re.search(message, text[len(f"{path}:2: ") :]), text
    assert isinstance(error.value, ConfigError) and error.value.exit_code == 2


def test_values_that_are_not_json_are_refused_naming_the_field():
    """Hugging Face rows may hold bytes, dates or images; they must not travel to the actors."""
    dataset = PromptDataset(PromptDataConfig(), None)
    with pytest.raises(
        PromptDataError,
        match=r"^ds \[train\] row 3: field 'image' holds a bytes, not a JSON value .*; add it "
        r"to data\.prompts\.exclude_fields$",
    ):
        dataset.to_sample({"prompt": "p", "image": b"\x89PNG"}, "ds [train] row 3")
    with pytest.raises(PromptDataError, match=r"field 'meta' holds a dict, not a JSON value"):
        dataset.to_sample({"prompt": "p", "meta": {1: "int key"}}, "r")
    with pytest.raises(PromptDataError, match=r"field 'answer' holds NaN, not a JSON value"):
        dataset.to_sample({"prompt": "p", "answer": float("nan")}, "r")
    kept = PromptDataset(PromptDataConfig(exclude_fields=["image"]), None).to_sample(
        {"prompt": "p", "image": b"\x89PNG", "n": 1}, "r"
    )
    assert kept.metadata == {"n": 1}


def test_file_problems_are_one_line_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.jsonl \(data\.prompts\.path\) does not exist"):
        load(tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "a"}', "[1, 2]"])
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: expected a JSON object"):
        load(bad)
    with pytest.raises(
        ConfigError, match=r"set data\.prompts\.path to a JSONL file or data\.prompts\.hf_dataset"
    ):
        PromptDataset(PromptDataConfig(), None).load("train")  # fmt: skip
    with pytest.raises(ValueError, match=r"path .* and hf_dataset .* are both set"):
        PromptDataConfig(path="a.jsonl", hf_dataset="org/name")
    with pytest.raises(ValueError, match=r"require_answer needs answer_field"):
        PromptDataConfig(answer_field=None, require_answer=True)


# -- splits --------------------------------------------------------------------------------------


def test_splits_come_from_the_validation_file_or_raise_key_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    val = write_jsonl(tmp_path / "val.jsonl", VAL_ROWS)
    with pytest.raises(KeyError):  # no validation source: the core holds one out
        load(train, "validation")
    with pytest.raises(KeyError):
        load(train, "test")
    samples = load(train, "validation", validation_path=str(val))
    assert [s.metadata["id"] for s in samples] == [101, 102]
    assert [s.metadata["id"] for s in load(train, max_samples=2)] == [1, 2]


def test_load_splits_holds_out_a_seeded_share_deterministically(tmp_path, nrl_registry):
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_splits

    rows = [{"prompt": f"p{i}", "answer": str(i), "id": i} for i in range(40)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)

    def splits(seed: int, *overrides: str):
        config = resolve_config(
            "grpo",
            overrides=[
                "data.dataset=prompts",
                f"data.prompts.path={path}",
                "data.val_fraction=0.25",
                *overrides,
            ],
            registry=nrl_registry,
        )
        train, val = load_splits(
            config.data, nrl_registry, ComponentContext(config=config, seed=seed)
        )
        return [s.metadata["id"] for s in train], [s.metadata["id"] for s in val]

    train, val = splits(1)
    assert len(val) == 10 and sorted(train + val) == list(range(40))
    assert train == sorted(train)  # the training rows keep the file's order
    assert splits(1) == (train, val)  # same seed, same split
    assert splits(2)[1] != val  # the hold-out follows the run's seed
    # A validation file replaces the hold-out; every training row is trained on.
    val_path = write_jsonl(tmp_path / "v.jsonl", VAL_ROWS)
    train, val = splits(1, f"data.prompts.validation_path={val_path}")
    assert train == list(range(40)) and val == [101, 102]


def test_a_jsonl_val_dataset_is_refused_naming_the_option_to_use(tmp_path, nrl_registry):
    """data.val_dataset=x.jsonl is read by the math plugin's `jsonl` dataset (\\boxed{}
    template, task math): for `prompts` that would silently change the validation prompts."""
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_splits

    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    config = resolve_config(
        "grpo",
        overrides=["data.dataset=prompts", f"data.prompts.path={path}", "data.val_dataset=v.jsonl"],
        registry=nrl_registry,
    )
    with pytest.raises(
        PromptDataError,
        match=r"^data\.val_dataset=v\.jsonl would be read by the math plugin's `jsonl` dataset, "
        r"not by `prompts`; set data\.prompts\.validation_path=v\.jsonl instead$",
    ):
        load_splits(config.data, nrl_registry, ComponentContext(config=config))
    data = DataConfig(tasks=[TaskConfig(name="k", dataset="prompts", val_dataset="w.jsonl")])
    with pytest.raises(PromptDataError, match=r"^data\.tasks\[0\]\.val_dataset=w\.jsonl would"):
        load(path, context=ComponentContext(config=type("C", (), {"data": data})()))


def test_tasks_rename_the_samples(tmp_path, nrl_registry):
    from nrl_core.config.loader import resolve_config
    from nrl_core.datasets import load_task_splits

    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    config = resolve_config(
        "grpo",
        overrides=[f"data.prompts.path={path}", "data.tasks=[{name: kw, dataset: prompts}]"],
        registry=nrl_registry,
    )
    train, val = load_task_splits(config.data, nrl_registry, ComponentContext(config=config))["kw"]
    assert {s.task for s in train + val} == {"kw"}
    assert sorted(s.metadata["id"] for s in train + val) == [1, 2, 3, 4]


# -- Hugging Face datasets ---------------------------------------------------------------------


def test_a_saved_hugging_face_dataset_is_read_with_its_splits(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="the `datasets` library is not installed (not an nrl-core dependency)"
    )
    folder = tmp_path / "hf"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [
                    {"question": "Say cat", "gold": "cat", "keyword": "cat", "level": 1},
                    {"question": "Say dog", "gold": "dog", "keyword": "dog", "level": 2},
                ]
            ),
            "test": datasets.Dataset.from_list(
                [{"question": "Say red", "gold": "red", "keyword": "red", "level": 3}]
            ),
        }
    ).save_to_disk(str(folder))
    options = PromptDataConfig(
        hf_dataset=str(folder),
        validation_split="test",
        prompt_field="question",
        answer_field="gold",
    )
    dataset = PromptDataset(options, None)
    train = dataset.load("train")
    assert [s.messages for s in train] == [
        [{"role": "user", "content": "Say cat"}],
        [{"role": "user", "content": "Say dog"}],
    ]
    assert [(s.answer, s.metadata) for s in train] == [
        ("cat", {"keyword": "cat", "level": 1}),
        ("dog", {"keyword": "dog", "level": 2}),
    ]
    assert [s.metadata["level"] for s in dataset.load("validation")] == [3]
    assert dataset.load("train") == train  # deterministic
    # Without validation_split the core holds a share of train out.
    with pytest.raises(KeyError):
        PromptDataset(PromptDataConfig(hf_dataset=str(folder)), None).load("validation")
    # A bad row is named by its split and row number.
    wrong = PromptDataset(PromptDataConfig(hf_dataset=str(folder)), None)
    with pytest.raises(
        PromptDataError,
        match=rf"^{folder} \[train\] row 1: no field 'prompt' \(fields: gold, keyword, level, "
        r"question\); set data\.prompts\.prompt_field",
    ):
        wrong.load("train")


def test_an_unreachable_hub_dataset_is_one_line(monkeypatch):
    pytest.importorskip("datasets", reason="the `datasets` library is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub on this machine: fail fast, not on DNS
    options = PromptDataConfig(hf_dataset="nrl-test/no-such-dataset")
    with pytest.raises(ConfigError) as error:
        PromptDataset(options, None).load("train")
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith(
        "data.prompts.hf_dataset=nrl-test/no-such-dataset (split 'train') cannot be loaded"
    )


# -- registration, config show, the conformance kit ---------------------------------------------


class TestPromptDatasetConformance(DatasetConformance):
    registered_name = "prompts"
    splits = ("train", "validation")

    @pytest.fixture
    def loader(self, tmp_path):
        options = PromptDataConfig(
            path=str(write_jsonl(tmp_path / "t.jsonl", ROWS)),
            validation_path=str(write_jsonl(tmp_path / "v.jsonl", VAL_ROWS)),
        )
        return PromptDataset(options, ComponentContext(config=None))


def test_config_show_lists_the_prompts_section(capsys):
    from nrl_core.cli import main

    assert (
        main(["config", "show", "grpo", "data.dataset=prompts", "data.prompts.path=x.jsonl"]) == 0
    )
    shown = capsys.readouterr().out
    section = shown[shown.index("\n  prompts:\n") :]
    for line in (
        "    path: x.jsonl",
        "    prompt_field: prompt",
        "    prompt_template: null",
        "    answer_field: answer",
        "    task: prompts",
        "    exclude_fields: []",
    ):
        assert f"\n{line}\n" in section, line


def _nrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nrl_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NRL_ACTOR_ENV": "system", **(env or {})},
    )


def test_a_bad_row_stops_nrl_run_with_one_line_and_exit_2(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])
    result = _nrl(
        "run",
        "grpo",
        "-q",
        f"logger.log_dir={tmp_path}",
        "data.dataset=prompts",
        f"data.prompts.path={path}",
        "env.name=exact_match",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: {path}:2: no field 'prompt' (fields: question); set data.prompts.prompt_field "
        "to the field holding the prompt"
    ]
    assert not (tmp_path / "default" / "metrics.jsonl").exists()  # nothing ran


def test_a_warm_up_on_samples_without_answers_is_refused_before_ray(tmp_path):
    """The grpo recipe's SFT warm-up trains on the answers: rows without one would teach the
    model to say "None" (before: trained silently)."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": "c"}])
    result = _nrl(
        "run", "grpo", "-q", f"logger.log_dir={tmp_path}", "data.dataset=prompts",
        f"data.prompts.path={path}", "data.val_fraction=0", "env.name=exact_match",
        "grpo.sft_warmup_steps=3",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: grpo.sft_warmup_steps=3 trains on the samples' answers, but 1 of 2 training "
        "samples have none; set grpo.sft_warmup_steps=0 or give every sample an answer "
        "(data.prompts.require_answer=true finds them)"
    ]
    assert not (tmp_path / "default" / "metrics.jsonl").exists()


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_run_hands_each_rows_extra_fields_to_the_environment(tmp_path):
    """`nrl run grpo` on a `prompts` JSONL with a test environment (installed as a plugin
    through its entry point) whose reward is the row's `bonus` field and which records the
    metadata it receives: every row's extra fields reach the environment actor unchanged."""
    site = tmp_path / "site"
    info = site / "nrl_prompt_metadata_env-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nrl-prompt-metadata-env\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[nrl.plugins]\nprompt_metadata = nrl_prompt_metadata_env\n"
    )
    shutil.copy(FIXTURES / "nrl_prompt_metadata_env.py", site)
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    val = write_jsonl(tmp_path / "val.jsonl", VAL_ROWS)

    start = time.monotonic()
    result = _nrl(
        "run",
        "grpo",
        "-q",
        f"logger.log_dir={tmp_path}",
        "logger.run_name=run",
        "checkpointing.enabled=false",
        "policy.backend=dtensor",
        # One rank, in the `nrl` process: the rows reach the environment as copies there too
        # (the in-process cluster copies what Ray would pickle), without starting Ray.
        "policy.num_workers=1",
        "cluster.num_cpus=2",
        "env.name=metadata_recorder",
        "data.dataset=prompts",
        f"data.prompts.path={train}",
        f"data.prompts.validation_path={val}",
        "data.prompts.task=keywords",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
        "grpo.sft_warmup_steps=0",
        # 4 prompts per step from 4 training rows: every step draws each row once.
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"nrl run grpo took {elapsed:.1f}s")

    expected = {}
    for row in ROWS + VAL_ROWS:
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        expected[row["id"]] = {**extra, "answer": row.get("answer"), "task": "keywords"}
    records = [
        json.loads(line)
        for line in (tmp_path / "run" / "env_metadata.jsonl").read_text().splitlines()
    ]
    seen: dict[int, int] = {}
    for record in records:
        meta = record["metadata"]
        assert meta == expected[meta["id"]]  # every field, nested values and nulls included
        seen[meta["id"]] = seen.get(meta["id"], 0) + 1
    # 2 steps x 4 responses per training row; validation (steps 0 and 2) once per row each.
    assert seen == {1: 8, 2: 8, 3: 8, 4: 8, 101: 2, 102: 2}
    prompts = {r["metadata"]["id"]: r["prompt"] for r in records}
    assert prompts[1] == [{"role": "user", "content": "Say cat"}]  # no hidden template
    assert prompts[2] == ROWS[1]["prompt"]  # a message-list prompt as given

    metrics = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        # The reward is each row's `bonus`: the mean over the 4 rows, whatever was generated.
        assert m["train/reward_mean"] == pytest.approx((0.0 + 0.25 + 0.5 + 1.0) / 4)
    for m in (metrics[0], metrics[2]):
        # Partial credit is no accuracy (issue 39): the mean reward is what validation reports.
        assert m["val/keywords/reward_mean"] == pytest.approx((0.75 + 0.25) / 2)
        assert "val/keywords/accuracy" not in m
