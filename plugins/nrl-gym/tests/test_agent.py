"""NeMo Gym results as trajectories (nrl_gym.agent), on a result captured from a real run of
nemo-gym 0.7.0 (example_single_tool_call + simple_agent against `nrl serve` on the tiny model)."""

import copy
import json
from pathlib import Path

from nrl_gym.agent import trajectory_of

RESULT = json.loads((Path(__file__).parent / "fixtures" / "run_result.json").read_text())


def test_each_model_call_of_a_real_result_becomes_one_model_call():
    trajectory = trajectory_of(RESULT)
    (item,) = [i for i in RESULT["response"]["output"] if "generation_token_ids" in i]
    (call,) = trajectory.calls
    assert call.prompt_token_ids == item["prompt_token_ids"]
    assert call.generation_token_ids == item["generation_token_ids"]
    assert call.generation_log_probs == item["generation_log_probs"]
    assert trajectory.reward == RESULT["reward"] and trajectory.failure_reason is None


def test_tool_outputs_carry_no_ids_and_a_second_call_is_kept_in_order():
    result = copy.deepcopy(RESULT)
    (item,) = [i for i in result["response"]["output"] if "generation_token_ids" in i]
    second = {**item, "generation_token_ids": [7], "generation_log_probs": [-0.5]}
    result["response"]["output"] += [{"type": "function_call_output", "output": "sunny"}, second]
    calls = trajectory_of(result).calls
    assert [c.generation_token_ids for c in calls] == [item["generation_token_ids"], [7]]


def test_failed_rows_come_back_with_a_reason_never_raise():
    assert "not a NeMo Gym result" in trajectory_of("Hit an exception ...").failure_reason
    masked = {**RESULT, "mask_sample": True, "failure_kind": "tool_error"}
    assert "tool_error" in trajectory_of(masked).failure_reason
    reasoned = {**RESULT, "failure_reason": "verifier crashed"}
    assert trajectory_of(reasoned).failure_reason == "verifier crashed"


def test_a_response_cut_by_max_output_tokens_finishes_by_length():
    cut = copy.deepcopy(RESULT)
    cut["response"]["incomplete_details"] = {"reason": "max_output_tokens"}
    assert trajectory_of(cut).finish_reason == "length"
    assert trajectory_of(RESULT).finish_reason == "stop"


def test_the_verifier_numbers_become_metrics_the_row_fields_do_not():
    row = {"responses_create_params": RESULT["responses_create_params"], "source_index": 3}
    result = {**RESULT, "source_index": 3, "score": 0.5, "won": True, "task_name": "sum"}
    assert trajectory_of(result, row).metrics == {"score": 0.5, "won": 1.0}
    assert trajectory_of(RESULT).metrics == {}
