"""The static memory of one policy GPU, computed from the model's shape before anything starts.

A layout that cannot fit should be refused in the driver, in a second, with the knob that makes
it fit, rather than by an out-of-memory error minutes into the first step (GPU review 3, M4).
:func:`plan_memory` counts, per GPU, what a policy rank holds for the whole run:

* **params**: the weights this rank holds (after tensor, pipeline and expert parallelism; and
  FSDP's shard on the dtensor backend), in their storage dtype;
* **grads**: the gradient buffer (Megatron keeps one unsharded buffer per rank, fp32 with
  ``grad_reduce_in_fp32``; FSDP keeps a sharded fp32 gradient);
* **optimizer**: Adam's fp32 main weights (when the weights are not fp32) and two fp32
  moments, sharded over the data-parallel ranks that hold the same weights: all DP ranks for
  dense weights, the *expert*-DP ranks for experts (Megatron: ``world / (etp x ep x pp)``, so
  EP=8 on 8 GPUs leaves expert-DP 1: unsharded), minus what is offloaded to the CPU;
* **gathered**: FSDP's all-gathered unit during compute (a block, or the whole model);
* **logits**: one fp32 copy of the logits of the largest micro batch (the biggest single
  activation: ``tokens x vocab / tp x 4`` bytes; other activations are not counted);

A colocated generation engine (vLLM, SGLang) shares each policy GPU, in turns
(docs/generation-engines.md, "Memory hand-off"): it sleeps, holding nothing, while the policy
trains (the phase above); at a refit it wakes its weights while the policy still holds its
weights and gradient buffer (the optimizer state went to the CPU first), so
``params + grads + the engine's weights`` must fit (:attr:`MemoryPlan.refit_total`); then the
policy moves its weights out and the engine takes its share (``gpu_memory_utilization`` /
``mem_fraction_static`` x the device), which must hold at least its own weights.

The shape comes from the model's ``config.json``, read as JSON (:meth:`ModelShape.from_config`),
never by importing a model. The layout comes from the policy backend's options through their
documented ``memory_layout(num_ranks=..., precision=...)`` method (a :class:`Layout`; see
:func:`layout_of`), so the core knows no plugin. Import-light (the standard library and
:mod:`nrl_core.errors`), so that :mod:`nrl_core.preflight`, which runs
:func:`check_memory_plan`, stays fast.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.errors import ConfigError

if TYPE_CHECKING:
    from nrl_core.registry import Registry

GIB = float(2**30)
WARN_FRACTION = 0.9
"""A plan above this share of the device memory (and at most all of it) is accepted with a
warning: activations beyond the counted logits need room too."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its parameter count.

    ``moe_layers`` of the ``num_layers`` layers hold ``num_experts`` routed experts of width
    ``moe_intermediate_size`` (plus a router, and a shared expert of width
    ``shared_expert_intermediate_size`` when it is above 0); the others a dense MLP of width
    ``intermediate_size``. Every MLP is gated (gate, up, down)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """The shape of a Hugging Face ``config.json`` (Llama, Mistral, Qwen2/2.5/3, Qwen2-MoE,
        Qwen3-MoE, Mixtral and models with the same keys). Raises ``ValueError`` naming the key
        when a needed one is missing."""
        config = dict(config.get("text_config") or config)  # multimodal wrappers

        def need(*keys: str) -> int:
            for key in keys:
                if config.get(key) is not None:
                    return int(config[key])
            raise ValueError(f"config.json has no {keys[0]}")

        hidden, layers = need("hidden_size"), need("num_hidden_layers")
        heads = need("num_attention_heads")
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        model_type = str(config.get("model_type", ""))
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        moe_layers = 0
        if experts:
            step = int(config.get("decoder_sparse_step") or 1)
            dense = set(config.get("mlp_only_layers") or ())
            moe_layers = sum(1 for i in range(layers) if (i + 1) % step == 0 and i not in dense)
        # Mixtral's experts have intermediate_size; Qwen-MoE's a moe_intermediate_size.
        moe_width = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.get("intermediate_size") or 0),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_intermediate_size=moe_width if experts else 0,
            moe_layers=moe_layers,
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> ModelShape:
        """The shape of a model folder's ``config.json``."""
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    # -- parameter counts ----------------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        """The input embedding (the LM head is the same size, and the same tensor when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        """One layer's attention with grouped-query heads, its norms and the MLP's norm."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.qkv_bias:
            params += q + 2 * kv
        if self.qk_norm:
            params += 2 * self.head_dim
        return params + 2 * self.hidden_size  # input and post-attention norms

    def _mlp(self, width: int) -> int:
        return 3 * self.hidden_size * width  # gate, up, down

    @property
    def expert_params_per_layer(self) -> int:
        """All routed experts of one MoE layer."""
        return self.num_experts * self._mlp(self.moe_intermediate_size)

    @property
    def dense_params_per_moe_layer(self) -> int:
        """What a MoE layer holds besides its routed experts: attention, norms, router, and a
        shared expert (with its one-output gate) when the model has one."""
        shared = self.shared_expert_intermediate_size
        extra = self._mlp(shared) + self.hidden_size if shared else 0
        return self.attention_params + self.hidden_size * self.num_experts + extra

    @property
    def dense_layer_params(self) -> int:
        """One layer without experts: attention, norms and a dense MLP."""
        return self.attention_params + self._mlp(self.intermediate_size)

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.expert_params_per_layer

    @property
    def head_params(self) -> int:
        """The final norm and the LM head (0 more when tied to the embedding)."""
        return self.hidden_size + (0 if self.tied_embeddings else self.embedding_params)

    @property
    def non_expert_params(self) -> int:
        dense_layers = self.num_layers - self.moe_layers
        return (
            self.embedding_params
            + self.head_params
            + dense_layers * self.dense_layer_params
            + self.moe_layers * self.dense_params_per_moe_layer
        )

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.expert_params


@dataclass(frozen=True)
class Layout:
    """How a policy backend places the model on its GPUs, as the memory plan needs it.

    A policy backend's options return one from ``memory_layout(num_ranks=..., precision=...)``
    (the documented protocol :func:`layout_of` calls; ``None`` when the layout is invalid, which
    the worker then reports). Sizes are degrees (each at least 1 and dividing ``world`` as the
    backend requires).

    Attributes:
        backend: the policy backend's name, for the messages.
        world: policy ranks, one per GPU.
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel degrees.
        etp: expert tensor parallel degree (Megatron's default: ``tp``).
        param_bytes: bytes per stored weight (2 for bf16, 4 for fp32 master weights).
        grad_bytes: bytes per gradient element (4 for fp32 gradients, 2 for bf16).
        fsdp: the weights and gradients are sharded over the data-parallel ranks (FSDP,
            ZeRO-3); otherwise each rank holds its whole (TP/PP/EP) part of them.
        gathered: with ``fsdp``, what is gathered to compute: ``"blocks"`` (one decoder
            block at a time) or ``"model"`` (all of it).
        vocab_tp: the embedding and LM head are split over ``tp`` (Megatron) or whole on every
            TP rank (the dtensor TP plan).
        main_params: Adam keeps fp32 main weights apart from the stored ones (bf16 weights).
        moment_bytes: optimizer state bytes per parameter besides main weights (8: Adam's two
            fp32 moments; 4: SGD's momentum).
        optimizer_offload: fraction of the optimizer state (0 to 1) kept on the CPU.
        offload_main_params: the offloaded fraction includes the fp32 main weights (otherwise
            they stay on the GPU, as with Megatron's hybrid optimizer without the
            precision-aware optimizer).
        params_offload: weights and gradients live on the CPU between uses (FSDP's
            ``cpu_offload``): only the gathered unit counts on the GPU.
        fixes: for an item name (``params``, ``grads``, ``optimizer``, ``gathered``,
            ``logits``, ``engine``), what shrinks it, as an instruction naming the setting
            (``set policy.megatron.grad_reduce_in_fp32=false``); the engine's is added by
            :mod:`nrl_core.preflight`.
    """

    backend: str
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    param_bytes: int = 2
    grad_bytes: int = 4
    fsdp: bool = False
    gathered: str = "blocks"
    vocab_tp: bool = True
    main_params: bool = True
    moment_bytes: int = 8
    optimizer_offload: float = 0.0
    offload_main_params: bool = True
    params_offload: bool = False
    fixes: dict[str, str] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        """Data-parallel ranks of the dense weights."""
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def expert_dp(self) -> int:
        """Data-parallel ranks holding the same experts: ``world / (etp x ep x pp)``
        (megatron-core 0.16 ``parallel_state.initialize_model_parallel``); FSDP shards the
        experts over its data-parallel ranks like any weight."""
        if self.fsdp:
            return self.dp
        etp = self.etp or self.tp
        return max(1, self.world // (etp * self.ep * self.pp))


@dataclass(frozen=True)
class Item:
    name: str
    nbytes: float
    note: str = ""

    def describe(self) -> str:
        """``fp32 grads 19.3 GiB``, ``optimizer 42.7 GiB at expert-DP 1``: the note names a
        dtype before the item, anything else after it."""
        if self.note in ("fp32", "bf16"):
            return f"{self.note} {self.name} {self.nbytes / GIB:.1f} GiB"
        note = f" {self.note}" if self.note else ""
        return f"{self.name} {self.nbytes / GIB:.1f} GiB{note}"


@dataclass(frozen=True)
class MemoryPlan:
    """The per-GPU static bytes of a layout (:func:`plan_memory`), by item, while the policy
    trains; and, with a colocated engine, its weights and its share of the GPU (0 without)."""

    items: tuple[Item, ...]
    device_bytes: float
    layout: Layout
    engine_weights: float = 0.0
    engine_share: float = 0.0

    @property
    def total(self) -> float:
        return sum(item.nbytes for item in self.items)

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)

    @property
    def refit_total(self) -> float:
        """At a refit into a colocated engine: the policy's weights and gradient buffer (its
        optimizer state is on the CPU) beside the engine's woken weights."""
        if not self.engine_weights:
            return 0.0
        return self.item("params").nbytes + self.item("grads").nbytes + self.engine_weights

    @property
    def fits(self) -> bool:
        return (
            self.total <= self.device_bytes
            and self.refit_total <= self.device_bytes
            and self.engine_weights <= self.engine_share
        )

    @property
    def tight(self) -> bool:
        return self.fits and self.total > WARN_FRACTION * self.device_bytes

    def _amount(self) -> str:
        return f"{self.total / GIB:.1f} of {self.device_bytes / GIB:.1f} GiB per GPU"

    def _biggest(self, n: int = 3) -> str:
        big = sorted((i for i in self.items if i.nbytes > 0), key=lambda i: -i.nbytes)[:n]
        return ", ".join(i.describe() for i in big)

    def _engine(self) -> str:
        if not self.engine_weights:
            return ""
        return (
            f"; colocated engine: weights {self.engine_weights / GIB:.1f} of its "
            f"{self.engine_share / GIB:.1f} GiB, refit peak {self.refit_total / GIB:.1f} GiB"
        )

    def summary(self) -> str:
        """The one line shown before Ray starts when the plan fits."""
        return (
            f"memory plan ({self.layout.backend}): {self._amount()} ({self._biggest(6)})"
            f"{self._engine()}"
        )

    def _fixes(self) -> str:
        fixes = self.layout.fixes
        big = sorted(self.items, key=lambda i: -i.nbytes)
        chosen = [fixes[i.name] for i in big if i.nbytes > 0 and i.name in fixes]
        unique = list(dict.fromkeys(chosen))[:3]
        return f"{' or '.join(unique)}, or use more GPUs" if unique else "use more GPUs"

    def refusal(self, key: str) -> str:
        """The one ``ConfigError`` line of a plan that does not fit: the training phase, else
        the refit into a colocated engine, else the engine's own share."""
        if self.total > self.device_bytes:
            return (
                f"{key}: the policy needs {self._amount()}, which does not fit "
                f"({self._biggest()}); {self._fixes()}"
            )
        engine = self.layout.fixes.get("engine", "use separate engines")
        weights = f"the colocated engine's weights ({self.engine_weights / GIB:.1f} GiB)"
        if self.refit_total > self.device_bytes:
            held = self.item("params").describe() + ", " + self.item("grads").describe()
            grads = self.layout.fixes.get("grads")
            return (
                f"{key}: at each refit the policy's {held} and {weights} need "
                f"{self.refit_total / GIB:.1f} of {self.device_bytes / GIB:.1f} GiB per GPU; "
                f"{engine}" + (f" or {grads}" if grads else "")
            )
        return (
            f"{key}: {weights} exceed its share of the GPU ({self.engine_share / GIB:.1f} of "
            f"{self.device_bytes / GIB:.1f} GiB); {engine} or raise that share"
        )

    def warning(self) -> str:
        """The one line of a plan within the device memory but above ``WARN_FRACTION``."""
        return (
            f"memory plan ({self.layout.backend}): {self._amount()}, above "
            f"{WARN_FRACTION:.0%} ({self._biggest()}); activations may not fit; to make room, "
            f"{self._fixes()}"
        )


def plan_memory(
    shape: ModelShape,
    layout: Layout,
    *,
    device_bytes: float,
    micro_batch_tokens: int = 0,
    engine_fraction: float = 0.0,
    engine_dtype_bytes: int = 2,
) -> MemoryPlan:
    """The static bytes per GPU of ``shape`` placed by ``layout`` (see the module docstring for
    what each item counts). The worst rank counts: the first or last pipeline stage, whichever
    holds more. ``micro_batch_tokens``: tokens of the largest micro batch (logits);
    ``engine_fraction``: the share of the device a colocated engine reserves (0: none), which
    holds the whole model in ``engine_dtype_bytes`` per weight (colocated engines have
    tensor parallel size 1)."""
    stages = layout.pp
    per_stage = math.ceil(shape.num_layers / stages)
    moe_per_stage = math.ceil(shape.moe_layers / stages)
    dense_per_stage = per_stage - moe_per_stage
    layers = (
        dense_per_stage * shape.dense_layer_params
        + moe_per_stage * shape.dense_params_per_moe_layer
    )
    # Megatron keeps a copy of a tied embedding on the last stage to compute the logits.
    head = shape.head_params if stages == 1 or not shape.tied_embeddings else shape.embedding_params
    ends = shape.embedding_params + head if stages == 1 else max(shape.embedding_params, head)
    vocab_split = layout.tp if layout.vocab_tp else 1
    dense = layers / layout.tp + ends / vocab_split
    experts = (
        moe_per_stage * shape.expert_params_per_layer / (layout.ep * (layout.etp or layout.tp))
    )

    dp, edp = layout.dp, layout.expert_dp
    shard_dense, shard_experts = (dp, edp) if layout.fsdp else (1, 1)
    held = dense / shard_dense + experts / shard_experts  # weights this rank stores
    on_gpu = 0.0 if layout.params_offload else 1.0
    params = held * layout.param_bytes * on_gpu
    grads = held * layout.grad_bytes * on_gpu

    main = 4 if layout.main_params else 0
    kept = 1.0 - layout.optimizer_offload
    per_param = layout.moment_bytes * kept + main * (kept if layout.offload_main_params else 1.0)
    if layout.params_offload:
        per_param = 0.0  # FSDP's CPU offload steps the optimizer on the CPU
    optimizer = per_param * (dense / dp + experts / edp)
    note = ""
    if shape.expert_params and edp < dp and per_param:
        note = f"at expert-DP {edp}"

    items = [Item("params", params), Item("grads", grads, _dtype_note(layout.grad_bytes))]
    items.append(Item("optimizer", optimizer, note))
    if layout.fsdp:
        unit = dense + experts if layout.gathered == "model" else _largest_block(shape, layout)
        items.append(Item("gathered", unit * 2))  # bf16 compute copy of the unit
    vocab = shape.vocab_size / vocab_split
    items.append(Item("logits", micro_batch_tokens / layout.cp * vocab * 4))
    engine_weights = shape.total_params * engine_dtype_bytes if engine_fraction else 0.0
    return MemoryPlan(
        tuple(items),
        float(device_bytes),
        layout,
        engine_weights=float(engine_weights),
        engine_share=engine_fraction * device_bytes,
    )


def _dtype_note(nbytes: int) -> str:
    return "fp32" if nbytes == 4 else "bf16"


def _largest_block(shape: ModelShape, layout: Layout) -> float:
    dense = shape.dense_layer_params if shape.moe_layers < shape.num_layers else 0
    moe = (
        shape.dense_params_per_moe_layer + shape.expert_params_per_layer if shape.moe_layers else 0
    )
    return max(dense, moe) / layout.tp


def layout_of(options: Any, *, num_ranks: int, precision: str) -> Layout | None:
    """The :class:`Layout` a policy backend's options describe: their
    ``memory_layout(num_ranks=..., precision=...)`` method (``precision``:
    ``policy.precision``), or ``None`` when the options have none (no plan) or the layout is
    invalid there."""
    method = getattr(options, "memory_layout", None)
    if not callable(method):
        return None
    return method(num_ranks=num_ranks, precision=precision)


def gpu_memory_bytes() -> float | None:
    """The memory of this machine's smallest NVIDIA GPU (bytes), from ``nvidia-smi`` (no CUDA
    context in the driver); ``None`` without a driver."""
    from nrl_core.distributed.devices import nvidia_smi

    try:
        mib = [float(line) for line in nvidia_smi("memory.total") or []]
    except ValueError:  # "[N/A]" on some virtualised GPUs
        return None
    return min(mib) * 2**20 if mib else None


# -- the preflight check (nrl_core.preflight) ------------------------------------------------


def _device_bytes(cluster: Any) -> float | None:
    if cluster is None:
        return None
    if getattr(cluster, "gpu_memory_gib", None):
        return cluster.gpu_memory_gib * 2**30
    if cluster.backend not in ("local", "auto"):
        return None  # the driver's GPUs (if any) are not the cluster's
    return gpu_memory_bytes()


def _model_config(name: str) -> dict[str, Any] | None:
    """A model's ``config.json`` as JSON: from its folder or the Hugging Face cache (no
    download: the plan is skipped for a model that is not here yet)."""
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a hub id; check_model_source has said why if it matters
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_memory_plan(config: Any, registry: Registry, *, verbose: bool = False) -> str | None:
    """The memory plan (:mod:`nrl_core.memory_plan`): the policy's static bytes per GPU from
    the model's ``config.json`` and the policy backend's layout (its options'
    ``memory_layout``), against the device memory (``cluster.gpu_memory_gib``, else measured on
    a local cluster). Above it: ``ConfigError``, one line naming the biggest items and the
    settings that shrink them. Returns the line to show: the plan, or a warning above
    :data:`WARN_FRACTION`. Without a plan (no GPU and no
    ``cluster.gpu_memory_gib``, a backend without ``memory_layout``, a model whose
    ``config.json`` is not here or has an unknown shape): ``None``, or with ``verbose`` a line
    saying why."""

    def skipped(why: str) -> str | None:
        return f"memory plan: skipped ({why})" if verbose else None

    policy = getattr(config, "policy", None)
    if policy is None or not hasattr(policy, "options_for"):
        return None
    layout = layout_of(
        policy.options_for(), num_ranks=policy.num_workers, precision=policy.precision
    )
    if layout is None:
        return skipped(f"policy.{policy.selected}: no layout to plan with these options")
    device = _device_bytes(getattr(config, "cluster", None))
    if not device:
        return skipped("no GPU seen here and cluster.gpu_memory_gib unset")
    model = _model_config(policy.model_name)
    if model is None:
        return skipped(f"no config.json here for policy.model_name={policy.model_name}")
    try:
        shape = ModelShape.from_config(model)
    except (ValueError, TypeError) as exc:
        return skipped(f"unknown model shape: {exc}")  # the run finds out itself
    length = policy.max_total_sequence_length
    train = policy.micro_batch_token_budget or policy.train_micro_batch_size * length
    tokens = max(train, policy.logprob_batch_size * length)
    engine, engine_bytes, fixes = 0.0, 2, dict(layout.fixes)
    generation = getattr(config, "generation", None)
    options = generation.options_for() if generation is not None else None
    fraction = getattr(options, "gpu_memory_fraction", None)
    spec = registry.find("generation", generation.backend) if generation is not None else None
    # A backend registered `colocated` (torch) generates inside the policy workers: no engine
    # (nrl_core.generation.runs_in_policy_workers, which imports Ray).
    in_policy = spec is None or bool(spec.metadata.get("colocated"))
    if callable(fraction) and getattr(options, "colocated", False) and not in_policy:
        engine = fraction() or 0.0
        engine_bytes = 4 if getattr(options, "dtype", "") == "float32" else 2
        fixes["engine"] = f"set generation.{generation.backend}.colocated=false"
    layout = replace(layout, fixes=fixes)
    plan = plan_memory(
        shape,
        layout,
        device_bytes=device,
        micro_batch_tokens=tokens,
        engine_fraction=engine,
        engine_dtype_bytes=engine_bytes,
    )
    if not plan.fits:
        gpus = f"{layout.world} GPU" + ("s" if layout.world > 1 else "")
        raise ConfigError(plan.refusal(f"policy.{policy.selected} on {gpus}"))
    return plan.warning() if plan.tight else plan.summary()
