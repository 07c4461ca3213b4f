"""The GPU engines' sleep rules as state (:mod:`nrl_core.memory_contract`), which the CPU
engines keep under ``NRL_MEMORY_CONTRACT=1``."""

from __future__ import annotations

import pytest
import torch

from nrl_core import memory_contract
from nrl_core.memory_contract import EngineMemory, MemoryContractError

pytestmark = pytest.mark.gpu_sim


def test_a_deep_sleep_loses_the_weights_until_a_refit_completes():
    memory = EngineMemory("e")
    memory.check_generate()  # a fresh engine holds its model folder's weights
    memory.sleep(keeps_weights=False)
    with pytest.raises(MemoryContractError, match="generate while"):
        memory.check_generate()
    with pytest.raises(MemoryContractError, match="refit started while the weights sleep"):
        memory.begin_refit()
    memory.wake_up()
    with pytest.raises(MemoryContractError, match="weights dropped at sleep"):
        memory.check_generate()  # awake is not enough
    memory.sleep(keeps_weights=False)
    memory.wake_up(["weights"])
    memory.begin_refit()
    memory.finish_refit()
    memory.wake_up(["kv_cache"])
    memory.check_generate()


def test_a_shallow_sleep_keeps_them_and_a_later_deep_one_cannot_revive_them():
    memory = EngineMemory("e")
    memory.sleep(keeps_weights=True)
    memory.wake_up()
    memory.check_generate()
    memory.sleep(keeps_weights=False)
    memory.sleep(keeps_weights=True)  # asleep already: nothing comes back
    memory.wake_up()
    with pytest.raises(MemoryContractError, match="weights dropped"):
        memory.check_generate()


def test_waking_an_awake_tag_is_an_error_and_changes_nothing():
    memory = EngineMemory("e")
    memory.sleep(keeps_weights=False)
    memory.wake_up(["weights"])
    for tags in (None, ["weights"], ["weights", "kv_cache"]):
        with pytest.raises(MemoryContractError, match=r"\['weights'\] is awake"):
            memory.wake_up(tags)
    assert memory.sleeping == {"kv_cache"}
    with pytest.raises(MemoryContractError, match="unknown memory tag"):
        memory.wake_up(["cuda_graphs"])


def test_drop_fills_floating_tensors_with_nan(monkeypatch):
    weights, counts = torch.ones(3), torch.ones(2, dtype=torch.int64)
    memory_contract.drop([weights, counts])
    assert torch.isnan(weights).all() and counts.tolist() == [1, 1]
    monkeypatch.setenv(memory_contract.ENV_VAR, "0")
    assert not memory_contract.enabled()
    monkeypatch.setenv(memory_contract.ENV_VAR, "1")
    assert memory_contract.enabled()
