"""Sequence packing: training-step and logprob-pass time, packed against padded, same run.

    uv run python benchmarks/packing.py [--rounds 3] [--models tiny,50m]

For each model (the bundled tiny one and a ~50M-parameter Llama built the same way) and each
batch (``long_tailed``: GRPO-like, lengths log-normal with a ~10x spread between the 5th and
95th percentile; ``equal``: as many tokens, every sample the same length, nothing to save),
three dtensor policies over the same weights (everything else the default:
``train_micro_batch_size=4``, ``logprob_batch_size=8``) each run a training step
(``Policy.train``: forward, backward, AdamW step) and a logprob pass (``Policy.get_logprobs``):
``packed`` (``policy.sequence_packing=true``), ``padded`` (``false``), and ``budget``: padded
training micro batches grouped longest first up to the packed bins' token budget
(``micro_batch_token_budget``, the fallback without packing, as many tokens per pass; its
logprob pass is the padded one). They take turns (rotating who goes first), ``--rounds`` times
after a warm-up step on two samples; the figures are medians of wall time and of this process's
CPU time (all threads: on a machine shared with other jobs wall time mostly measures the
scheduler, CPU time the work). Each line is ``model=… batch=… pass=<train|logprobs>_<wall|cpu>
padded_s=… padded_budget_s=… packed_s=… ratio=… ratio_to_budget=…``; the last is
``packed_over_unpacked=<float>``: packed over padded CPU time, training step + logprob pass,
summed over the models, on the long-tailed batch (target <= 0.6; on the equal batch <= 1.05,
printed before it as ``equal_packed_over_unpacked``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import attrs
import torch

VARIANTS = ("padded", "budget", "packed")

MODELS = {
    # The default tiny model of the tests; 32 samples of up to 512 tokens.
    "tiny": ({}, 32, 512),
    # ~50M parameters: 12 layers of hidden 512 (GQA 8/4 heads, MLP 2048), 3.9M each; 16 samples
    # of up to 256 tokens (10-104 drawn) keep a padded step within minutes on 2 shared cores.
    "50m": ({"hidden_size": 512, "num_layers": 12, "num_heads": 8, "num_kv_heads": 4,
             "intermediate_size": 2048, "max_position_embeddings": 4096}, 16, 256),
}  # fmt: skip
"""name -> (tiny-model builder arguments, samples per batch, longest sample in tokens)."""


def lengths_for(kind: str, samples: int, longest: int, seed: int) -> list[int]:
    """Sample lengths: log-normal (median ``longest / 8``, sigma 0.7: the 5th-95th percentile
    spread is e^(2 x 1.645 x 0.7) ~ 10x) cut to [8, longest]; ``equal``: as many tokens, every
    sample the mean length."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(samples, generator=g) * 0.7) * (longest / 8)
    lengths = [int(x) for x in raw.clamp(8, longest).round()]
    if kind == "equal":
        return [round(sum(lengths) / samples)] * samples
    return lengths


def make_batch(lengths: list[int], seed: int):
    from nrl_core.data import Batch, pad_sequences

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(7, 100, (n,), generator=g).tolist() for n in lengths]
    ids = pad_sequences(seqs, pad_value=0)
    num, width = ids.shape
    lengths_t = torch.tensor(lengths)
    pos = torch.arange(width)[None, :]
    # GRPO: a short prompt, the response is what the loss reads.
    loss_mask = ((pos >= 4) & (pos < lengths_t[:, None])).float()
    advantages = torch.randn(num, generator=g)[:, None].expand(num, width).clone()
    return Batch(
        {
            "input_ids": ids,
            "lengths": lengths_t,
            "loss_mask": loss_mask,
            "advantages": advantages,
            "sample_mask": torch.ones(num),
        }
    )


def make_policy(model_path: Path, variant: str, longest: int):
    """``packed``; ``padded``: the default padded micro batches (4 samples each); ``budget``:
    padded micro batches grouped longest first up to the packed bins' token budget (the
    fallback of a backend without packing, with the same tokens per pass)."""
    from nrl_dtensor.config import DTensorConfig
    from nrl_dtensor.worker import DTensorPolicyWorker

    from nrl_core.config.schema import GRPOConfig, PolicyConfig
    from nrl_core.distributed.worker_group import InProcessGroup
    from nrl_core.interfaces import ComponentContext
    from nrl_core.policy import Policy

    policy = PolicyConfig(
        model_name=str(model_path),
        train_global_batch_size=1024,
        max_total_sequence_length=longest,
        sequence_packing=variant == "packed",
    )
    if variant == "budget":
        budget = policy.train_micro_batch_size * longest  # the packed bins' default
        policy = attrs.evolve(policy, micro_batch_token_budget=budget)
    config = GRPOConfig(seed=0, policy=policy)
    context = ComponentContext(config=config, rank=0, world_size=1, seed=0)
    worker = DTensorPolicyWorker(DTensorConfig(), context)
    return Policy.from_config(InProcessGroup(worker), config.policy)


def timed(fn) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process, all threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(model_path: Path, batch, rounds: int, longest: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of a training step and of a logprob pass, by variant."""
    from nrl_core.losses.clipped_pg import ClippedPGLoss

    policies = {v: make_policy(model_path, v, longest) for v in VARIANTS}
    assert policies["packed"].packing and not policies["padded"].packing
    loss = ClippedPGLoss()
    for policy in policies.values():  # warm-up: first-call costs (allocator, thread pools)
        policy.train(batch.slice(0, 2), loss)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {"train": {}, "logprobs": {}}
    for round_ in range(rounds):
        # Taking turns, and rotating who goes first, spreads the machine's load over all.
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            policy = policies[variant]
            times["train"].setdefault(variant, []).append(
                timed(lambda p=policy: p.train(batch, loss))
            )
            times["logprobs"].setdefault(variant, []).append(
                timed(lambda p=policy: p.get_logprobs(batch))
            )
    return {
        f"{name}_{clock}": {v: statistics.median(t[index] for t in seen) for v, seen in by.items()}
        for name, by in times.items()
        for index, clock in enumerate(("wall", "cpu"))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="tiny,50m")
    args = parser.parse_args()

    from safetensors.torch import load_file

    from nrl_core.testing.tiny import tiny_model_path

    totals = {"long_tailed": [0.0, 0.0], "equal": [0.0, 0.0]}
    for name in args.models.split(","):
        builder, samples, longest = MODELS[name]
        path = tiny_model_path(**builder)
        params = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
        for kind in totals:
            lengths = lengths_for(kind, samples, longest, seed=1)
            batch = make_batch(lengths, seed=2)
            padding = 1 - sum(lengths) / (len(lengths) * max(lengths))
            result = measure(path, batch, args.rounds, longest)
            for what, by in result.items():
                if what.endswith("_cpu"):
                    totals[kind][0] += by["padded"]
                    totals[kind][1] += by["packed"]
                print(
                    f"model={name} params={params / 1e6:.1f}M batch={kind} "
                    f"tokens={sum(lengths)} lengths={min(lengths)}-{max(lengths)} "
                    f"padding_if_one_micro_batch={padding:.2f} pass={what} "
                    f"padded_s={by['padded']:.3f} padded_budget_s={by['budget']:.3f} "
                    f"packed_s={by['packed']:.3f} ratio={by['packed'] / by['padded']:.3f} "
                    f"ratio_to_budget={by['packed'] / by['budget']:.3f}",
                    flush=True,
                )
    print(f"equal_packed_over_unpacked={totals['equal'][1] / totals['equal'][0]:.3f}")
    print(f"packed_over_unpacked={totals['long_tailed'][1] / totals['long_tailed'][0]:.3f}")


if __name__ == "__main__":
    main()
