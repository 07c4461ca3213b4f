"""The supervised warm-up on the training prompts' answers: GRPO's ``grpo.sft_warmup_steps``
(the policy) and distillation's ``distill.teacher_warmup_steps`` (the teacher)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nrl_core.algorithms.session.run_session import RunSession
from nrl_core.data import Batch, pad_sequences


def answer_warmup(
    session: RunSession,
    policy: Any,
    steps: int,
    *,
    template: str,
    batch_size: int,
    shuffle_answers: bool = False,
) -> list[float]:
    """``steps`` supervised optimizer steps of ``policy`` (a :class:`~nrl_core.policy.Policy`)
    on the training prompts and their answers, each rendered with ``template`` (``{answer}``),
    ``batch_size`` prompts per step; the training stream is rewound afterwards. With
    ``shuffle_answers`` each prompt gets another prompt's answer. Returns the step losses."""
    s = session
    rng = random.Random(f"{s.config.seed}-sft-warmup")
    nll = s.registry.get("loss", "nll").load()(None, None)
    losses = []
    for _ in range(steps):
        prompts = s.train_stream.take(batch_size)
        answers = [str(p.answer) for p in prompts]
        if shuffle_answers:
            rng.shuffle(answers)
        rows = []
        for sample, answer in zip(prompts, answers, strict=True):
            prompt = s.codec.encode_prompt(s.codec.prompt_messages(sample))
            text = template.format(answer=answer)
            response = [
                *s.tokenizer(text, add_special_tokens=False)["input_ids"],
                s.tokenizer.eos_token_id,
            ]
            rows.append((prompt, response))
        batch = supervised_batch(rows, s.tokenizer.pad_token_id)
        losses.append(policy.train(batch, nll)["loss"])
    # The warm-up drew from the training stream; the run starts from its beginning.
    s.train_stream.rewind()
    return losses


def supervised_batch(rows: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> Batch:
    """(prompt ids, response ids) pairs as a training batch with the loss on the responses."""
    return Batch(
        {
            "input_ids": pad_sequences([p + r for p, r in rows], pad_value=pad_token_id),
            "lengths": torch.tensor([len(p) + len(r) for p, r in rows]),
            "loss_mask": pad_sequences(
                [[0.0] * len(p) + [1.0] * len(r) for p, r in rows], dtype=torch.float32
            ),
        }
    )
