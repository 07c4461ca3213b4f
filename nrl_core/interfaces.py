"""The interfaces plugins implement, one small protocol per component kind.

Plugins own per-rank compute; the core owns everything between ranks (sharding, gathering,
the RL loop). A policy plugin therefore implements a handful of per-rank methods, and the core's
facades fan batches out to the workers and gather the results.

Construction: every component class is built as ``Cls(options, context)``, where ``options`` is
the instance of the component's registered config class (``None`` when it registers none) and
``context`` a :class:`ComponentContext` with the run-wide settings it may need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch

    from nrl_core.data import Batch, Endpoint, Message, Sample, Trajectory
    from nrl_core.weight_sync import BucketHandle, BucketMeta


@attrs.frozen
class ComponentContext:
    """Run-wide settings handed to every component next to its own options."""

    config: Any
    """The whole resolved run config (an attrs object, see :mod:`nrl_core.config.schema`)."""
    rank: int = 0
    """This worker's global rank in its worker group (0 outside worker groups)."""
    world_size: int = 1
    """Number of workers in the group."""
    seed: int = 0
    """The run's seed; components derive their own streams from it."""
    lora_adapter_rank: int = 0
    """For generation engines: the policy's LoRA rank (>= 1) when the run refits them with
    adapters only (``generation.lora_refit``, :mod:`nrl_core.weight_sync.adapters`), else 0.
    Set by the core, which reads the policy's options; an engine's venv cannot (its copy of
    ``config`` keeps only the options it can import)."""


# ---------------------------------------------------------------------------------------------
# Policy


@attrs.frozen
class GlobalBatchStats:
    """Normalisers of the loss over the WHOLE global batch (all micro batches, all DP ranks).

    The core computes them once per training step and hands them to every loss call, so that
    summing the per-micro-batch losses on every rank gives exactly the global loss whatever
    the micro batch size or the number of ranks.
    """

    valid_tokens: float
    """Sum of ``loss_mask`` (times ``sample_mask``) over the global batch."""
    valid_sequences: float
    """Number of samples with ``sample_mask`` 1 and at least one valid token."""
    max_sequence_length: int
    """The constant length normaliser of Dr. GRPO-style aggregation (``policy.max_total_sequence_length``)."""


@runtime_checkable
class LossFunction(Protocol):
    """A loss over per-token logprobs; runs inside the policy workers.

    The returned loss of one micro batch must already be divided by the global normaliser in
    ``stats`` (not by the micro batch's own counts), so that the sum over micro batches and
    data-parallel ranks equals the loss of the global batch. Metrics are reduced by the core
    over micro batches and ranks (:func:`nrl_core.training.reduce_metrics`): by default each
    value is an additive contribution (summed); a loss declares other reductions in the
    optional ``metric_reductions`` mapping (metric name -> ``"sum"``, ``"mean"``, ``"max"`` or
    ``"min"``; undeclared keys ending in ``_max`` / ``_min`` take the max / min). The ``loss``
    metric is always the value of the returned loss (set by the core).
    """

    needs_reference: bool
    """True when the batch must carry ``ref_logprobs`` (the policy then builds a reference copy)."""
    needs_prev_logprobs: bool
    """True when the batch must carry ``prev_logprobs`` recomputed by the trainer."""

    # Optional: ``logprobs_at_key: str`` names a batch key of ``[B, T, K]`` token ids at which
    # the loss also needs the policy's logprobs (with the graph); the core then puts them in
    # ``batch["logprobs_at"]`` (``[B, T, K]``) before calling the loss. Distillation uses it for
    # the teacher's top-k ids.

    def __call__(
        self, logprobs: torch.Tensor, batch: Batch, stats: GlobalBatchStats
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one micro batch; ``logprobs`` is ``[B, T]`` aligned
        with ``batch["input_ids"]`` (0 on padding) and carries the graph for backward."""
        ...


class PolicyWorker(Protocol):
    """One rank of a policy (trainer). Built as ``Cls(options, context)`` in a Ray actor.

    A policy plugin owns per-rank compute only: a forward for logprobs, a forward + backward
    for one micro batch, the optimizer step, and state I/O. The core
    (:mod:`nrl_core.training`, :class:`nrl_core.policy.Policy`) shards batches over
    data-parallel ranks, splits micro batches, normalises the loss, accumulates and reduces
    metrics; every method here is called on all ranks together (tensor-parallel peers with the
    same data), the same number of times on every rank.

    ``torch.distributed`` is already configured through the environment variables ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.

    Contract on gradients: the worker's gradient reduction AVERAGES over data-parallel ranks
    (what FSDP and DDP do); the core multiplies each loss by the data-parallel size to undo it.

    Optional: a worker that must see all micro batches of an optimizer step at once (a pipeline
    schedule interleaves them across stages) defines
    ``forward_backward_micro_batches(items) -> bool``, with ``items`` the ``(micro batch, loss
    closure)`` pairs in order; the core then calls it instead of :meth:`forward_backward`, and it
    returns whether this rank called the closures (only a pipeline's last stage does;
    :func:`nrl_core.training.train_on_rank`).

    Optional, likewise for logprobs: ``compute_logprobs_micro_batches(micro_batches, *,
    reference=False) -> list[torch.Tensor]`` takes all of a rank's logprob (or reference)
    micro batches of one call at once, in order, fillers included (the same count on every
    rank), and returns one :meth:`compute_logprobs` result per micro batch, in order. The core
    (:func:`nrl_core.training.logprobs_on_rank`) then calls it instead of
    :meth:`compute_logprobs`, so a pipeline schedule overlaps its stages over the micro batches.
    Only the ranks the core reads results from (a pipeline's last stage) need real values;
    others return tensors of the right shape.
    """

    def compute_logprobs(self, micro_batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs ``[B, T]`` of ``micro_batch["input_ids"]`` (``T`` its width;
        position 0 holds 0), without a graph, under the current weights or, with
        ``reference``, the frozen reference weights (``policy.model_name`` unless
        :meth:`set_reference` named others). Values past ``lengths`` are ignored."""
        ...

    def forward_backward(
        self, micro_batch: Batch, loss: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Training forward of ``micro_batch`` (train mode, with a graph): compute its
        per-token logprobs ``[B, T]`` as :meth:`compute_logprobs` does, call ``loss`` on them
        exactly once, and back-propagate the scalar it returns. Gradients accumulate over calls
        until :meth:`optimizer_step`.

        When ``loss.logprobs_at_ids`` is not None (a ``[B, T, K]`` long tensor: a distillation
        loss wants the policy's distribution at a teacher's top-k ids), call
        ``loss(logprobs, logprobs_at)`` instead, with ``logprobs_at[b, t, j]`` the logprob of
        token ``logprobs_at_ids[b, t, j]`` at position ``t`` (the distribution that predicts
        token ``t``; row 0 holds 0), from the same forward and with the graph. A backend
        that cannot (Megatron's vocabulary-parallel logits) leaves it out; ``nrl run distill``
        then refuses it at start."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip the accumulated gradients to ``policy.max_grad_norm`` (0: no clipping), step the
        optimizer and the learning-rate schedule, and zero the gradients. Returns
        ``grad_norm`` (before clipping, over the whole model) and ``lr`` (the rate this step
        used), identical on every rank. Further keys are this rank's own metrics of the step
        (e.g. router statistics, ``moe/*``): the core reduces them over ranks as the worker's
        optional ``metric_reductions`` mapping (``{key: "sum" | "mean" | "max" | "min"}``)
        declares, else by :func:`nrl_core.training.metric_reduction`."""
        ...

    def set_reference(self, model_path: str) -> None:
        """Load the Hugging Face folder ``model_path`` as the frozen reference (used by
        ``compute_logprobs(..., reference=True)``), sharded like the policy."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, scheduler and RNG states under ``path`` (all ranks call)."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        ...

    def export_hf(self, path: str) -> None:
        """Write a Hugging Face folder (safetensors, config, tokenizer) loadable by
        ``from_pretrained``."""
        ...

    # Optional: ``supports_sequence_packing: bool`` (an attribute or property; absent means
    # False). When true, and ``policy.sequence_packing`` is ``auto`` or ``true``, the core sends
    # ``compute_logprobs``, ``forward_backward`` and ``compute_topk_logprobs`` a
    # :class:`nrl_core.packing.PackedSequences` instead of a ``Batch``: the micro batch's samples
    # in one padding-free row ``[1, total]`` with restarted ``position_ids`` and the boundaries
    # ``cu_seqlens``. The worker computes as for a batch of one row, attending within each
    # sample only, and returns ``[1, total]`` (``[1, total, K]``) values; the core unpacks them
    # to ``[B, T]`` (a packed loss closure takes the ``[1, total]`` logprobs, and its
    # ``logprobs_at_ids`` are packed ``[1, total, K]``). A plugin that registers its policy with
    # ``sequence_packing=True`` lets ``policy.sequence_packing=true`` pass the preflight.

    # Optional, for a distillation teacher (``nrl run distill``):
    # ``compute_topk_logprobs(micro_batch, k) -> (token_logprobs, topk_logprobs, topk_ids)``:
    # without a graph, under the current weights, the ``[B, T]`` logprobs of the batch's tokens
    # and the ``[B, T, k']`` logprobs and ids of the ``k' = min(k, vocabulary)`` most likely
    # tokens at each position (position 0 holds 0), all from one forward.

    # Optional: ``generate(prompts, params, stop_strings)`` as in :class:`GenerationWorker`,
    # for colocated generation on the policy's own weights (``generation.backend=torch``).

    # Required for engines colocated on the policy's GPUs (vLLM, SGLang with colocated=true),
    # which need the GPU memory the policy holds while they generate:
    #
    # ``offload(what: list[str]) -> None`` moves ``"optimizer"`` state and/or ``"weights"``
    # (parameters, gradients, buffers) to CPU memory and empties the CUDA cache;
    # ``onload() -> None`` brings back everything offloaded. No-ops on CPU. The core
    # (:class:`nrl_core.generation.GenerationEngines`) calls ``offload(["optimizer"])`` before
    # a refit, ``offload(["weights"])`` after it, and ``onload()`` before the policy's next
    # logprob, training or checkpoint call.


# ---------------------------------------------------------------------------------------------
# Generation


@attrs.frozen
class SamplingParams:
    """How to sample one generation call."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@attrs.frozen
class GenerationOutput:
    """Generated continuation of each prompt: token ids only, never text."""

    token_ids: list[list[int]]
    """Generated ids per sample (the prompt excluded; the stop token included when hit)."""
    logprobs: list[list[float]]
    """The raw (not renormalised) logprob of each generated id under the sampling policy."""
    finish_reasons: list[str]
    """``"stop"`` (stop token or string) or ``"length"`` (``max_new_tokens`` reached)."""
    routed_experts: list[Any] | None = None
    """For a mixture of experts, when routing is recorded (``policy.moe.record_routing`` or
    ``router_replay``): per sample, the top-k expert ids of every MoE layer for every position
    of prompt + generation the engine ran, an integer array ``[tokens, layers, k]`` (numpy or
    torch; :data:`nrl_core.data.NOT_RECORDED` where it ran none; rows past the end, e.g. the
    last generated token, may be missing). None when the engine records no routing."""
    routing_weights: list[Any] | None = None
    """The gate weights of :attr:`routed_experts`' experts, per sample a float array of the
    same shape, when the engine gives them (the torch engine; vLLM returns ids only)."""
    weight_versions: list[list[int]] | None = None
    """Per sample, the version of the weights (optimizer steps in them, >= 0) that generated
    each of its :attr:`token_ids`. An engine that refits while a call runs fills it; otherwise
    :class:`~nrl_core.algorithms.async_grpo.WeightGate` does (a refit waits for the calls in
    flight, so one call has one version). None when unknown (no refit yet)."""

    @staticmethod
    def concat(parts: Sequence[GenerationOutput]) -> GenerationOutput:
        """The outputs of several engines (or ranks), in order; routing only when every part
        has it."""
        routed = [part.routed_experts for part in parts]
        weights = [part.routing_weights for part in parts]
        return GenerationOutput(
            token_ids=[ids for part in parts for ids in part.token_ids],
            logprobs=[lps for part in parts for lps in part.logprobs],
            finish_reasons=[r for part in parts for r in part.finish_reasons],
            routed_experts=(
                [e for part in routed for e in part]
                if parts and all(r is not None for r in routed)
                else None
            ),
            routing_weights=(
                [w for part in weights for w in part]
                if parts and all(w is not None for w in weights)
                else None
            ),
            weight_versions=(
                [v for part in parts for v in part.weight_versions]
                if parts and all(part.weight_versions is not None for part in parts)
                else None
            ),
        )


class GenerationWorker(Protocol):
    """A generation backend (one engine, or one rank of a colocated backend)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt. ``stop_strings`` optionally adds per-sample stop strings
        (from the environment) to ``params.stop_strings``."""
        ...


class WeightSync(Protocol):
    """Receives a policy's current weights into a generation engine that holds its own copy.

    Implemented by the engine workers of backends such as vLLM and SGLang; colocated ``torch``
    generation shares the policy's weights and needs none. The sender
    (:class:`nrl_core.weight_sync.WeightSender`) streams the full, unsharded state dict in
    size-bounded buckets, each a flat buffer plus its layout, through a transport (CUDA IPC,
    an NCCL broadcast, or shared memory); names are already the engine's. Every call is a plain
    Ray method call, so nothing here is a generator.
    """

    def begin_weight_update(self) -> None:
        """Prepare to receive (wake a sleeping engine's weights, pause generation)."""
        ...

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Load one bucket (``meta``: names, shapes, dtypes, offsets; ``handle``: where its bytes
        are); return the number of bytes received."""
        ...

    def finish_weight_update(self) -> None:
        """Finish: post-process the loaded weights and drop caches built from the old ones."""
        ...


class LoraAdapterSync(Protocol):
    """Takes adapter-only LoRA refits (``generation.lora_refit=adapters``): an engine whose
    options class sets ``accepts_lora_adapters`` implements this besides :class:`WeightSync`
    (which still loads the base weights when the engine lacks them). See
    :mod:`nrl_core.weight_sync.adapters`."""

    def load_lora_adapter(self, adapter: Any, meta: BucketMeta, handle: BucketHandle) -> int:
        """Serve the adapter in one bucket (PEFT's saved names, ``base_model.model.<module>.
        lora_A.weight``...) with its settings ``adapter`` (a
        :class:`~nrl_core.weight_sync.adapters.LoraAdapter`: rank, alpha, target modules,
        version) on the base weights the engine holds, in place of the previous adapter, for
        every later request; return the bytes received."""
        ...


# ---------------------------------------------------------------------------------------------
# Environment


@attrs.frozen
class EnvStep:
    """An environment's answer for one sample after one turn."""

    reward: float | dict[str, float]
    """A float, or named rewards (their sum is the training reward)."""
    terminated: bool = True
    """True ends the episode; False asks for another turn."""
    observation: Message | None = None
    """A message appended to the conversation before the next turn (role and content)."""
    stop_strings: tuple[str, ...] | None = None
    """Stop strings for the model's next turn."""
    metadata: dict[str, Any] | None = None
    """Carried to this sample's next ``step`` call (``None`` keeps the previous metadata)."""
    failure: str | None = None
    """Set when the environment could not score this sample and gave a stand-in reward
    (normally 0): ``"error"`` (its check raised), ``"timeout"`` or ``"crashed"`` (a helper
    process died), optionally followed by ``": <detail>"``. The core counts it in
    ``train/env_<kind>_frac``, warns and may stop the run (``env.warn_failed_fraction``,
    ``env.stop_failed_fraction``)."""


class Environment(Protocol):
    """Rewards and multi-turn interaction; runs as a Ray actor in its plugin's environment.

    Conversations arrive as role/content messages (token ids stay in the core). ``step`` gets a
    batch and returns one :class:`EnvStep` per sample. Raising for a sample is allowed: the core
    counts it in ``train/env_errors`` and gives that sample reward 0.
    """

    def step(
        self, conversations: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> list[EnvStep]: ...

    # Optional: ``def metrics(self, batch: dict[str, Any]) -> dict[str, float]`` — environment
    # level metrics from the rewards, conversations and metadata of a finished batch.

    defines_correctness: bool = False
    """Optional (default False): the reward says whether a response is correct (1.0 correct,
    0.0 wrong). Only then does validation report ``val/accuracy`` and ``nrl eval`` accuracy and
    pass@k; otherwise they report the mean reward (``val/reward_mean``), which for partial
    credit is no accuracy. Read from the environment object, so it may depend on its options."""


# ---------------------------------------------------------------------------------------------
# Agent


class Agent(Protocol):
    """Drives rollouts itself, calling the policy over HTTP like an OpenAI model.

    Built as ``Cls(options, context)`` in a Ray actor in its plugin's environment. The agent
    may call the endpoint's ``/v1/chat/completions`` (every assistant message it gets back
    carries ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``; sent
    back in the history, they make the next prompt token-exact), ``/tokenize`` or
    ``/inference/v1/generate`` (:mod:`nrl_core.serving`), as many times per row as it likes,
    concurrently across rows. A row that fails is returned with ``failure_reason`` set (the core
    masks it out of the loss and counts it), never raised; raising fails the whole batch.
    """

    def run(self, rows: Sequence[dict[str, Any]], endpoint: Endpoint) -> list[Trajectory]:
        """One :class:`~nrl_core.data.Trajectory` per row, in the order of ``rows``.

        A row is the sample's ``metadata`` (for a JSONL dataset: the row's own fields) plus
        ``messages`` (the prompt), ``answer`` and ``task``."""
        ...

    # Optional: ``close() -> None``, called once when the run ends (stop servers it started).


# ---------------------------------------------------------------------------------------------
# Cluster and datasets


@attrs.frozen
class ClusterResources:
    """What a cluster can offer to worker groups."""

    num_nodes: int
    cpus_per_node: list[float]
    gpus_per_node: list[float]

    @property
    def total_cpus(self) -> float:
        return sum(self.cpus_per_node)

    @property
    def total_gpus(self) -> float:
        return sum(self.gpus_per_node)


class Cluster(Protocol):
    """Starts or connects to Ray. Built as ``Cls(options, context)``."""

    def start(self) -> ClusterResources:
        """Initialise Ray in this process and report the resources."""
        ...

    def shutdown(self) -> None:
        """Release what :meth:`start` created; never stops a cluster it did not start."""
        ...


class DatasetLoader(Protocol):
    """Loads a dataset's samples. Built as ``Cls(options, context)``."""

    def load(self, split: str) -> list[Sample]:
        """``split`` is ``"train"`` or ``"validation"``; raise ``KeyError`` for a split that
        the dataset does not have."""
        ...


class ToolParser(Protocol):
    """Parses tool calls out of the policy endpoint's generated text
    (:mod:`nrl_core.serving.tool_calls`, whose ``ToolParser`` base class implements this).
    Built with no arguments, in the driver."""

    special_tokens: Sequence[str]
    """Special tokens the parser reads: the generated ids are decoded keeping them."""

    def parse(
        self, text: str, tools: list[dict[str, Any]] | None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)``: the calls in OpenAI's shape (arguments as a JSON
        string), the text outside them as content (None if none); never raises."""
        ...

    def opening(self, name: str | None) -> str | None:
        """The text that opens a call to ``name`` (None: to any function, up to its name), as
        the chat template writes it; None when the parser cannot force a call."""
        ...
