"""The ``policy`` section (model, precision, batch sizes, optimizer) and the ``loss`` section."""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs

from nrl_core.config.schema.fields import (
    NON_EMPTY,
    ComponentSection,
    Valid,
    between,
    ge,
    gt,
    one_of,
    option,
    optional,
)
from nrl_core.lr_schedule import LR_DECAYS
from nrl_core.registry import ComponentKind

OPTIMIZERS = ("adamw", "sgd")
"""``policy.optimizer.name`` values."""


PRECISIONS = ("float32", "bfloat16")
"""``policy.precision`` values (``nrl_core.policy_setup.PRECISIONS`` maps them to dtypes)."""


@attrs.define
class OptimizerConfig:
    name: str = option(
        "adamw", "Optimizer: `adamw` (torch.optim.AdamW) or `sgd`.", validator=one_of(*OPTIMIZERS)
    )
    lr: float = option(1e-5, "Peak learning rate.", validator=gt(0))
    weight_decay: float = option(0.0, "Decoupled weight decay.", validator=ge(0))
    betas: list[float] = option(
        [0.9, 0.999],
        "Adam betas.",
        validator=Valid(
            "two numbers in [0, 1)",
            lambda b: isinstance(b, list) and len(b) == 2 and all(0 <= x < 1 for x in b),
        ),
    )
    eps: float = option(1e-8, "Adam epsilon.", validator=gt(0))
    warmup_steps: int = option(
        0,
        "Linear warm-up over this many optimizer steps, from `lr / warmup_steps` up to `lr`.",
        validator=ge(0),
    )
    decay: str = option(
        "constant",
        (
            "Learning rate after the warm-up: `constant`, or `linear` / `cosine` decay from `lr` "
            "to `lr * min_lr_ratio` over `decay_steps` optimizer steps (then held there). Every "
            "optimizer step counts, a supervised warm-up's (`grpo.sft_warmup_steps`) too."
        ),
        validator=one_of(*LR_DECAYS),
    )
    decay_steps: int | None = option(
        None,
        "Optimizer steps the decay lasts (>= 1; needed when `decay` is not `constant`).",
        validator=optional(ge(1)),
    )
    min_lr_ratio: float = option(
        0.0,
        "The rate at the end of the decay, as a fraction of `lr` (0 to 1).",
        validator=between(0, 1),
    )

    def __attrs_post_init__(self) -> None:
        # A decay without a length has no schedule to follow; guessing the run's step count
        # would differ between algorithms (a supervised warm-up's steps count too).
        if self.decay != "constant" and self.decay_steps is None:
            raise ValueError(
                f"decay={self.decay} needs decay_steps (the optimizer steps it lasts, e.g. "
                "the run's max_num_steps plus its warm-up steps); or set decay=constant"
            )


@attrs.define
class MoeConfig:
    """Mixture-of-experts settings (ignored for a dense model unless a setting needs experts)."""

    record_routing: bool = option(
        False,
        (
            "Generation engines return the top-k experts every MoE layer chose for each token "
            "(`routed_experts` in the rollout batch) and training logs "
            "`train/moe/routing_agreement`, the fraction of tokens the trainer routes to the "
            "same experts. Engines: torch, vllm. Implied by `router_replay`."
        ),
    )
    router_replay: bool = option(
        False,
        (
            "R3: the trainer's forwards (logprobs and training) route each token to the experts "
            "the generation engine chose, with the engine's gate weights where it gives them "
            "(torch), else weights recomputed from the trainer's router logits over those "
            "experts (renormalised like the model's top-k; vllm). Needs a MoE model, "
            "a policy backend that replays (dtensor) and an engine that records (torch, vllm). "
            "See docs/moe.md, router replay."
        ),
    )

    @property
    def records_routing(self) -> bool:
        """Whether the engines return routing (``record_routing`` or ``router_replay``)."""
        return self.record_routing or self.router_replay


@attrs.define
class PolicyConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "policy"
    selector: ClassVar[str] = "backend"

    backend: str = option("dtensor", "Registered policy backend (`dtensor`, `megatron`).")
    model_name: str = option(
        "tiny",
        "Hugging Face model name or local folder; `tiny` builds the bundled tiny model.",
        validator=NON_EMPTY,
    )
    tokenizer_name: str | None = option(None, "Tokenizer name or folder (default: model_name).")
    precision: str = option(
        "float32",
        "Parameter/compute precision: `float32` or `bfloat16`.",
        validator=one_of(*PRECISIONS),
    )
    num_workers: int = option(
        1, "Number of policy ranks (Ray actors), one per GPU on GPU.", validator=ge(1)
    )
    train_global_batch_size: int = option(
        32, "Samples per optimizer step, over all ranks.", validator=ge(1)
    )
    train_micro_batch_size: int = option(
        4,
        "Samples per forward/backward on one rank (at most train_global_batch_size).",
        validator=ge(1),
    )
    micro_batch_token_budget: int | None = option(
        None,
        (
            "If set (>= 1), pack training micro batches up to this many unpadded tokens "
            "(longest first) instead of train_micro_batch_size samples."
        ),
        validator=optional(ge(1)),
    )
    sequence_packing: Literal["auto", True, False] = option(
        "auto",
        (
            "Pack each micro batch's samples into one padding-free row (restarted position "
            "ids, per-sample boundaries) for training and logprob passes: `auto` packs where "
            "the policy backend supports it (dtensor, megatron), `true` requires it, `false` "
            "computes on "
            "padded micro batches. Packed bins hold micro_batch_token_budget tokens, else at "
            "most the tokens of the padded path's largest micro batch of the same data "
            "(train_micro_batch_size or logprob_batch_size rows x its longest sample). See "
            "docs/configuration.md, sequence packing, for when to turn it off."
        ),
        validator=Valid("`auto`, `true` or `false`", lambda v: v == "auto" or isinstance(v, bool)),
    )
    logprob_batch_size: int = option(
        8, "Samples per forward when computing logprobs.", validator=ge(1)
    )
    max_total_sequence_length: int = option(
        512,
        "Longest prompt + response, in tokens (1 to 16,777,216: far beyond any model's context).",
        validator=between(1, 2**24),
    )
    max_grad_norm: float = option(
        1.0, "Gradient clipping norm (0 disables clipping).", validator=ge(0)
    )
    optimizer: OptimizerConfig = option(OptimizerConfig(), "Optimizer and LR schedule.")
    moe: MoeConfig = option(
        MoeConfig(), "Mixture of experts: routing record and replay (docs/moe.md)."
    )


@attrs.define
class LossConfig(ComponentSection):
    component_kind: ClassVar[ComponentKind] = "loss"
    selector: ClassVar[str] = "name"

    name: str = option("clipped_pg", "Registered loss function.")
