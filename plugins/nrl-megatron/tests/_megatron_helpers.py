"""Megatron-only test helpers (importable by the spawned ranks): probes, converters' checks,
the optimizer stand-in; the loss, batches and rank pool shared with other policy plugins are in
:mod:`nrl_core.testing`."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nrl_core.data import Batch, pad_sequences


def _have_megatron() -> bool:
    try:  # find_spec of a submodule raises when the parent package is missing
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


HAVE_MEGATRON = _have_megatron()
NO_MEGATRON = "megatron-core not installed (run nox -s plugin-megatron)"
requires_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason=NO_MEGATRON)


class ForwardProbe:
    """Runs in a spawned rank (torch.distributed set up from the environment): builds the
    Megatron GPTModel of a HF folder with converted weights and returns its logits next to
    Hugging Face's, both in float32 on CPU."""

    def __init__(self, path: str, converter: str = "right") -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from nrl_megatron.convert import ModelShape, hf_to_megatron
        from nrl_megatron.model import build_gpt_model, transformer_config
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        shape = ModelShape.from_hf_config(self.hf.config)
        state = hf_to_megatron(self.hf.state_dict(), shape)
        if converter == "naive_qkv":
            # Negative control: [q; k; v] stacked without per-group interleaving.
            for i in range(shape.num_layers):
                p = f"model.layers.{i}.self_attn."
                sd = self.hf.state_dict()
                state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat(
                    [sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]]
                )
        self.model = build_gpt_model(self.hf.config, transformer_config(self.hf.config)).eval()
        result = self.model.load_state_dict(state, strict=False)
        self._unloaded = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        # Negative controls: every attention without one of its options (gpt-oss: sinks,
        # window; Llama 4: chunks, temperature tuning, q/k L2 norm).
        dropped = {
            "no_sinks": "softmax_offset",
            "no_window": "window",
            "no_chunks": "chunk",
            "no_temperature": "temperature",
            "no_qk_norm": "qk_norm_eps",
        }.get(converter)
        if dropped is not None:
            from nrl_megatron.model import SDPAttention

            for module in self.model.modules():
                if isinstance(module, SDPAttention):
                    setattr(module, dropped, None)

    def unloaded(self) -> list[str]:
        """The Megatron parameters the converted state dict did not provide (none for a
        complete converter)."""
        return self._unloaded

    def logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(megatron_logits, hf_logits)``, each ``[B, T, V]``."""
        positions = torch.arange(input_ids.shape[1])[None, :].expand(input_ids.shape[0], -1)
        with torch.no_grad():
            return self.model(input_ids, positions, None), self.hf(input_ids=input_ids).logits

    def router_gemms(self, input_ids: torch.Tensor) -> tuple[int, int, dict[str, float]]:
        """One forward counted by the router statistics: ``(router GEMMs run, MoE layers,
        moe/* metrics)``; each ``gating`` call is one GEMM over the layer's tokens."""
        from nrl_megatron.moe import RouterStatistics

        from nrl_core.data import Batch

        stats = RouterStatistics(self.model)
        calls = []
        for router in stats.routers:
            gating = router.gating

            def counted(x, gating=gating):
                calls.append(1)
                return gating(x)

            router.gating = counted
        positions = torch.arange(input_ids.shape[1])[None, :].expand(input_ids.shape[0], -1)
        with torch.no_grad(), stats.collecting(Batch({"input_ids": input_ids})):
            self.model(input_ids, positions, None)
        return len(calls), len(stats.routers), stats.metrics()


def assert_every_rank_streams_the_checkpoint(group, path) -> None:
    """On every rank of ``group``, the streamed export (``state_dict_buckets``: shards gathered,
    converted back to Hugging Face names) is bit-identical to ``path``'s ``model.safetensors``."""
    from pathlib import Path

    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(path) / "model.safetensors"))
    for buckets in group.run_all("state_dict_buckets", 1 << 16):
        exported = {k: v for bucket in buckets for k, v in bucket.items()}
        assert exported.keys() == checkpoint.keys()
        for name, tensor in checkpoint.items():
            assert torch.equal(exported[name], tensor), name


def greedy_hf(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations under the Hugging Face model (full forward each step, no stops)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt) :])
    return out


def sequences_batch(prompts: list[list[int]], generated: list[list[int]]) -> Batch:
    """``prompt + generated`` rows, right padded, for ``get_logprobs``."""
    rows = [list(p) + list(g) for p, g in zip(prompts, generated, strict=True)]
    return Batch(
        {
            "input_ids": pad_sequences(rows, pad_value=0),
            "lengths": torch.tensor([len(r) for r in rows]),
        }
    )


class ParallelStateProbe:
    """Runs in a spawned rank: sets up ``torch.distributed`` (gloo) and a one-rank Megatron
    ``parallel_state``, which building any Megatron module needs; test functions then run on
    it through ``SpawnGroup.run_all(fn, ...)``."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)


def build_with_gpu_config(_probe, path: str) -> dict:
    """In a spawned rank with ``parallel_state`` up: the GPU path's ``TransformerConfig``
    (bfloat16, ``on_gpu=True``), the local-spec ``GPTModel`` built from it on the host, and a
    forward of it next to Hugging Face's float32 logits."""
    import dataclasses

    from nrl_megatron.convert import ModelShape, hf_to_megatron
    from nrl_megatron.model import build_gpt_model, transformer_config
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = transformer_config(hf.config, dtype=torch.bfloat16, on_gpu=True)
    fused = (
        "persist_layer_norm",
        "masked_softmax_fusion",
        "bias_dropout_fusion",
        "bias_activation_fusion",
        "gradient_accumulation_fusion",
    )
    flags = {name: getattr(config, name) for name in fused}
    # The one GPU-only step: allocating the weights on torch.cuda.current_device(). Everything
    # else (every module's constructor and its asserts, the bf16 forward) is the GPU config's.
    host = dataclasses.replace(config, use_cpu_initialization=True)
    model = build_gpt_model(hf.config, host).eval()
    state = hf_to_megatron(hf.state_dict(), ModelShape.from_hf_config(hf.config))
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    ids = torch.randint(7, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None, :].expand(2, -1)
    with torch.no_grad():
        got = model(ids, positions, None).float()
        want = hf(input_ids=ids).logits
    return {
        "use_cpu_initialization": config.use_cpu_initialization,
        "bf16": config.bf16,
        "flags": flags,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "got": got,
        "want": want,
    }


class ParameterStateOptimizer:
    """The checkpoint contract of Megatron-Core 0.16.1's ``DistributedOptimizer`` around the
    CPU worker's torch optimizer (the real one needs CUDA): ``state_dict()`` holds the
    parameter groups but no per-parameter state (Adam's moments, main weights;
    ``optimizer/distrib_optimizer.py:628-634``), ``load_state_dict`` leaves fresh state behind
    (``:690``), and only ``save_parameter_state`` / ``load_parameter_state`` carry that state.

    Before the first step both fail as Megatron's do: ``state_dict()`` takes the step count
    from Adam's per-parameter state and asserts there is exactly one (``:638-640``, torch's Adam
    without Apex or Transformer Engine), and ``save_parameter_state`` reads each parameter's
    ``exp_avg`` (``get_parameter_state_dp_zero`` through
    ``_get_main_param_and_optimizer_states``, ``:883-908``), which does not exist yet.
    ``optimizer`` is the wrapped torch optimizer, as Megatron names it."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        steps = {float(s["step"]) for s in self.optimizer.state.values()}
        assert len(steps) == 1  # as distrib_optimizer.py:640
        return {"param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})

    def save_parameter_state(self, filename: str) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                tensors = {"param": param, **self.optimizer.state.get(param, {})}
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    tensors[key]  # KeyError before the first step, as Megatron's
        torch.save(self.optimizer.state_dict()["state"], filename)

    def load_parameter_state(self, filename: str) -> None:
        state = self.optimizer.state_dict()
        state["state"] = torch.load(filename, weights_only=True)
        self.optimizer.load_state_dict(state)

    def reload_model_params(self) -> None:
        """Megatron copies the model's weights into its float32 main weights; the CPU
        optimizer steps the model's own parameters, so there is nothing to copy."""


def checkpoint_through_parameter_state(worker, action: str, path: str) -> None:
    """``worker.save_checkpoint(path)`` or ``load_checkpoint(path)`` with its optimizer seen as
    the GPU path sees Megatron's distributed optimizer (:class:`ParameterStateOptimizer`)."""
    inner = worker.optimizer
    worker.optimizer = worker.megatron_optimizer = ParameterStateOptimizer(inner)
    try:
        getattr(worker, action)(path)
    finally:
        worker.optimizer, worker.megatron_optimizer = inner, None


class RecordingMegatronWorker:
    """The megatron policy worker (in a spawned rank) that records whether each micro batch
    came packed or padded (``seen()``), and hands back its full weights in Hugging Face names
    (``weights()``, gathered over tensor parallelism)."""

    def __new__(cls, *args, **kwargs):
        from nrl_megatron.worker import MegatronPolicyWorker

        from nrl_core.packing import PackedSequences

        class Recording(MegatronPolicyWorker):
            def __init__(self, *a, **kw) -> None:
                super().__init__(*a, **kw)
                self.kinds: list[str] = []

            def _record(self, micro_batch) -> None:
                packed = isinstance(micro_batch, PackedSequences)
                self.kinds.append("packed" if packed else "padded")

            def forward_backward(self, micro_batch, loss):
                self._record(micro_batch)
                return super().forward_backward(micro_batch, loss)

            def forward_backward_micro_batches(self, items):
                # What the core calls for a step (the worker has it at every stage count).
                for micro_batch, _ in items:
                    self._record(micro_batch)
                return super().forward_backward_micro_batches(items)

            def compute_logprobs_micro_batches(self, micro_batches, **kw):
                # What the core calls for logprobs (compute_logprobs goes through it too).
                for micro_batch in micro_batches:
                    self._record(micro_batch)
                return super().compute_logprobs_micro_batches(micro_batches, **kw)

            def seen(self) -> list[str]:
                return list(self.kinds)

            def weights(self) -> dict[str, torch.Tensor]:
                return {k: v for b in self.state_dict_buckets(1 << 30) for k, v in b.items()}

        return Recording(*args, **kwargs)


class CountingReadsWorker:
    """The megatron policy worker (in a spawned rank) that counts the checkpoint files this rank
    opened (``safe_open``, how transformers reads tensors from disk) while it built the policy
    and, on ``build_reference()``, the frozen reference."""

    def __new__(cls, *args, **kwargs):
        import transformers.modeling_utils as modeling_utils
        from nrl_megatron.worker import MegatronPolicyWorker

        opened: list[str] = []
        original = modeling_utils.safe_open

        def counting_safe_open(file, *a, **kw):
            opened.append(str(file))
            return original(file, *a, **kw)

        class Counting(MegatronPolicyWorker):
            def reads(self) -> int:
                return len(opened)

            def build_reference(self) -> int:
                """The reference's own reads (a collective: it builds on every rank)."""
                before = len(opened)
                modeling_utils.safe_open = counting_safe_open
                try:
                    self.reference.model()
                finally:
                    modeling_utils.safe_open = original
                return len(opened) - before

        modeling_utils.safe_open = counting_safe_open
        try:
            return Counting(*args, **kwargs)
        finally:
            modeling_utils.safe_open = original


def spy_on_pipeline_schedules(worker) -> None:
    """Record ``num_microbatches`` of every call of Megatron-Core's pipeline schedule in this
    rank (:func:`schedule_calls` reads them): the worker looks the schedule up at each call."""
    import megatron.core.pipeline_parallel as pipeline_parallel

    real = pipeline_parallel.get_forward_backward_func
    worker.schedule_calls = []

    def recorded():
        schedule = real()

        def call(*args, **kwargs):
            worker.schedule_calls.append(kwargs["num_microbatches"])
            return schedule(*args, **kwargs)

        return call

    pipeline_parallel.get_forward_backward_func = recorded


def schedule_calls(worker) -> list[int]:
    """The ``num_microbatches`` of each schedule call since :func:`spy_on_pipeline_schedules`."""
    return list(worker.schedule_calls)


def one_logprob_call_per_chunk(worker) -> None:
    """Hide the worker's all-at-once logprob method from the core, which then calls
    ``compute_logprobs`` once per chunk (what the core did before it had the method)."""
    worker.compute_logprobs_micro_batches = None


class LiveTensorSpy:
    """Wraps a worker's tensor generator (an instance attribute shadowing the method) and, at
    each tensor it yields, measures the tensors it yielded before that are still alive
    (weak references): the peak count and bytes held at once, what the generator's consumers
    keep."""

    def __init__(self, worker, method: str) -> None:
        import weakref

        self.refs: list[weakref.ref] = []
        self.peak_count = self.peak_bytes = self.largest = 0
        inner = getattr(worker, method)

        def spied(*args, **kwargs):
            for name, tensor in inner(*args, **kwargs):
                self.refs.append(weakref.ref(tensor))
                self.largest = max(self.largest, _nbytes(tensor))
                self._measure()
                yield name, tensor
                del tensor  # held by the consumer only, from here on

        setattr(worker, method, spied)

    def _measure(self) -> None:
        live = [t for t in (ref() for ref in self.refs) if t is not None]
        self.peak_count = max(self.peak_count, len(live))
        self.peak_bytes = max(self.peak_bytes, sum(_nbytes(t) for t in live))

    def report(self) -> dict[str, int]:
        import gc

        gc.collect()
        live = [t for t in (ref() for ref in self.refs) if t is not None]
        return {
            "yielded": len(self.refs),
            "largest": self.largest,
            "peak_count": self.peak_count,
            "peak_bytes": self.peak_bytes,
            "retained_bytes": sum(_nbytes(t) for t in live),
        }


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def export_with_live_tensor_spies(worker, path: str) -> dict[str, dict[str, int]]:
    """``worker.export_hf(path)`` with :class:`LiveTensorSpy` on the whole-model stream and on
    this stage's gathered tensors; the spies' reports."""
    spies = {
        method: LiveTensorSpy(worker, method)
        for method in ("_full_megatron_tensors", "_stage_tensors")
    }
    try:
        worker.export_hf(path)
    finally:
        for method in spies:
            delattr(worker, method)
    return {method: spy.report() for method, spy in spies.items()}


def value_head_state(worker) -> dict:
    """In a spawned rank: the critic's value head weight (``None`` on a stage without it) and
    whether the LM output layer's weight is gone from the model."""
    from nrl_megatron.model import VALUE_HEAD

    state = worker.module.state_dict()
    head = state.get(VALUE_HEAD)
    return {
        "head": None if head is None else head.detach().clone(),
        "lm_head": "output_layer.weight" in state,
        "tensor_model_parallel": any(
            getattr(p, "tensor_model_parallel", False)
            for n, p in worker.module.named_parameters()
            if n == VALUE_HEAD
        ),
    }
