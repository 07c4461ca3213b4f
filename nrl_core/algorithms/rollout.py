"""Single- and multi-turn rollouts, token ids end to end.

Each turn: generate; let the environment step the batch; append its observation as token ids;
stop samples that terminate, run out of turns or hit the sequence budget. The training sequence
of an episode is the concatenation of exactly the ids that were generated or fed to the model —
never a re-tokenisation of decoded text — and its loss mask covers only the generated ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nrl_core.chat_data import apply_template
from nrl_core.data import Batch, Message, Sample, pad_sequences, token_id_problem
from nrl_core.env_failures import failure_of
from nrl_core.interfaces import GenerationOutput, SamplingParams
from nrl_core.moe import (
    NOT_RECORDED,
    ROUTED_EXPERTS,
    ROUTING_WEIGHTS,
    merge_routing,
    routing_array,
    routing_weight_array,
)

if TYPE_CHECKING:
    from nrl_core.agents import Trajectory

GenerateFn = Callable[
    [Sequence[Sequence[int]], SamplingParams, Sequence[Sequence[str] | None] | None],
    GenerationOutput,
]


def interruptible(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread, the calling thread waiting for it in short slices: a Ctrl-C
    (KeyboardInterrupt) or SIGTERM handler runs at once, not when a long call into native
    code that holds the signal (a tokenizer over megabytes of text) returns."""
    import threading

    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=run, name="nrl-interruptible", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if failure:
        raise failure[0]
    return result[0]


class ChatCodec:
    """Turns messages into token ids with the tokenizer's chat template, and ids into text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        apply_chat_template: format with the tokenizer's chat template (else join contents).
        system_prompt: prepended as a system message when the sample has none.
        vocab_size: one past the largest token id the model has (its config's ``vocab_size``,
            often above the tokenizer's length: embeddings padded to a multiple, whose ids the
            policy can sample); None: the tokenizer's length.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.use_template = apply_chat_template and getattr(tokenizer, "chat_template", None)
        self.system_prompt = system_prompt
        self.vocab_size = max(vocab_size or 0, len(tokenizer))

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.use_template:
            return apply_template(self.tokenizer, plain, add_generation_prompt)
        return "\n".join(m["content"] for m in plain) + ("\n" if add_generation_prompt else "")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_messages(self, sample: Sample) -> list[Message]:
        messages = [dict(m) for m in sample.messages]
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages  # type: ignore[return-value]

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self._encode(self._render(messages, add_generation_prompt=True))

    def prompt_lengths(
        self, samples: Sequence[Sample], chunk_size: int = 1024, longest: int | None = None
    ) -> list[int]:
        """``len(encode_prompt(prompt_messages(sample)))`` for each sample.

        The texts are tokenised ``chunk_size`` (>= 1) at a time: one batched call of a fast
        tokenizer is much quicker than one call per prompt on a large dataset, and gives the
        same ids (no padding, no special tokens added). With ``longest`` (tokens), a text too
        long in characters to fit in it whatever its tokens (more characters than ``longest``
        times the tokenizer's longest token) is not tokenised: its length is given as
        ``longest + 1`` (tokenising a 50 MB line took minutes). A Ctrl-C stops the tokenizer
        at once (it runs in a thread: the Rust call would hold the signal until it ends).
        """
        texts = [
            self._render(self.prompt_messages(sample), add_generation_prompt=True)
            for sample in samples
        ]
        too_long = longest * self._longest_token_chars() if longest is not None else None
        lengths: list[int] = []
        for start in range(0, len(texts), max(1, chunk_size)):
            chunk = texts[start : start + chunk_size]
            fits = [i for i, t in enumerate(chunk) if too_long is None or len(t) <= too_long]
            found: dict[int, int] = {}
            if fits:  # (a tokenizer refuses an empty batch)
                encoded = interruptible(
                    lambda fits=fits, chunk=chunk: self.tokenizer(
                        [chunk[i] for i in fits], add_special_tokens=False
                    )
                )
                found = dict(zip(fits, (len(ids) for ids in encoded["input_ids"]), strict=True))
            lengths.extend(found.get(i, (longest or 0) + 1) for i in range(len(chunk)))
        return lengths

    def _longest_token_chars(self) -> int:
        """The most characters one token of the tokenizer stands for (its vocabulary's longest
        entry, special tokens included; at least 1)."""
        vocab = self.tokenizer.get_vocab()
        return max(1, max((len(token) for token in vocab), default=1))

    def encode_observation(self, history: Sequence[Message], observation: Message) -> list[int]:
        """The ids that follow ``history`` when ``observation`` is appended and the model is
        prompted again: only the new text, so earlier ids are never re-tokenised.

        Normally that is the text the template adds to ``history``'s rendering. Templates that
        rewrite earlier turns once a new message follows (Qwen3 and DeepSeek-R1 strip
        ``<think>...</think>`` from past assistant turns) make the two renderings differ before
        the new text; then see :meth:`_observation_turn`.
        """
        before = self._render(history, add_generation_prompt=False)
        after = self._render([*history, observation], add_generation_prompt=True)
        if after.startswith(before):
            return self._encode(after[len(before) :])
        return self._observation_turn(observation)

    def _observation_turn(self, observation: Message) -> list[int]:
        """The template's ids for ``observation`` as a turn that follows an assistant turn,
        without the conversation's opening (BOS, a default system prompt).

        Rendering the observation alone would put the template's opening in the middle of the
        sequence. Instead a fixed stand-in exchange, a user prompt and an assistant reply with
        no reasoning block (so there is nothing for the template to rewrite), is rendered with
        and without the observation, and the text after the stand-in reply is compared: the
        reply's own closing (end-of-turn marker and separator, as in ``before``) is common to
        both, the rest is the observation's turn and the next generation prompt. Anchoring on
        the reply rather than on the whole prefix keeps working when the template renders the
        LAST assistant turn differently from earlier ones (Qwen3 adds an empty think block to
        the last one only). The common part is measured in token ids, not characters, so a
        closing that differs inside a special token (``<|end|>`` vs ``<|eot|>``) is never cut
        in the middle. The real history is not used: whatever the template does to it, those
        ids are already in the sequence and must stay as they were generated.
        """
        exchange: list[Message] = [
            {"role": "user", "content": _STAND_IN_PROMPT},
            {"role": "assistant", "content": _STAND_IN_REPLY},
        ]
        before = self._render(exchange, add_generation_prompt=False)
        after = self._render([*exchange, observation], add_generation_prompt=True)
        if _STAND_IN_REPLY in before and _STAND_IN_REPLY in after:
            before = before[before.index(_STAND_IN_REPLY) + len(_STAND_IN_REPLY) :]
            after = after[after.index(_STAND_IN_REPLY) + len(_STAND_IN_REPLY) :]
        before_ids, after_ids = self._encode(before), self._encode(after)
        return after_ids[_common_prefix_length(before_ids, after_ids) :]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


_STAND_IN_PROMPT = "nrl stand-in prompt"
_STAND_IN_REPLY = "nrl stand-in reply"
"""Contents of the exchange that :meth:`ChatCodec._observation_turn` renders: plain text that no
template rewrites and no observation or preamble is expected to contain."""


def _common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    """How many leading items ``left`` and ``right`` share."""
    size = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        size += 1
    return size


@attrs.define
class Episode:
    """One sample's conversation as it is rolled out."""

    group: int
    """Index of the prompt this episode answers (its GRPO group)."""
    task: str
    messages: list[Message]
    metadata: dict[str, Any]
    token_ids: list[int]
    prompt_length: int
    loss_mask: list[float] = attrs.field(factory=list)
    gen_logprobs: list[float] = attrs.field(factory=list)
    reward: float = 0.0
    turns: int = 0
    env_errors: int = 0
    env_failure: str | None = None
    """The first environment failure of this episode (``kind: detail``, kind one of
    :data:`nrl_core.env_failures.FAILURE_KINDS`), or None."""
    finish_reason: str = "stop"
    truncated: bool = False
    done: bool = False
    stop_strings: tuple[str, ...] | None = None
    noncontiguous: bool = False
    """An agent's model call whose prompt did not start with everything before it: the
    sequence is not what was sampled, so the episode is masked out of the loss."""
    failure: str | None = None
    """Why an agent-driven episode failed (masked out of the loss), or None."""
    agent_metrics: dict[str, float] = attrs.field(factory=dict)
    """The agent's own numbers for this episode (:attr:`Trajectory.metrics`)."""
    routed_experts: Any = None
    """The engine's routing of every token so far (int16 ``[len(token_ids), layers, k]``,
    :data:`nrl_core.data.ROUTED_EXPERTS`), or None when the engine recorded none."""
    routing_weights: Any = None
    """The engine's gate weights of those experts (float32, same shape), or None when it gave
    none."""
    weight_versions: list[int] = attrs.field(factory=list)
    """The weights' version (optimizer steps, :attr:`~nrl_core.interfaces.GenerationOutput.
    weight_versions`) of each generated token, in order (the tokens where ``loss_mask`` is 1
    that the rollout generated); empty when the engine's versions are unknown."""
    partial: bool = False
    """Whether a response of this episode was cut by ``max_tokens_per_call`` and continued in
    a later call (a partial rollout, :func:`rollout`)."""
    turn_tokens: int = 0
    """Tokens generated so far in a turn that is not over (a partial rollout waiting to be
    continued); 0 between turns."""
    age: int | None = None
    """How many optimizer steps the weights that train this episode are ahead of the oldest
    weights that generated it (asynchronous GRPO; None elsewhere)."""
    is_weight: dict[str, float] | None = None
    """The importance weights ``exp(old - gen)`` of its trained tokens, summarised (``mean``,
    ``min``, ``max``), when the step computed the trainer's logprobs; None otherwise."""
    loss_excluded: list[int] = attrs.field(factory=list)
    """Positions in ``token_ids`` kept out of the loss although generated (tokens of weights
    older than the age bound, ``grpo.async.over_age=mask``): :func:`episodes_to_batch` zeroes
    their ``loss_mask``; the episode's own ``loss_mask`` (its response length) is unchanged."""

    def __attrs_post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [0.0] * len(self.token_ids)
            self.gen_logprobs = [0.0] * len(self.token_ids)

    @property
    def trainable(self) -> bool:
        """False for an agent's failed or non-contiguous episode: its ids are not a sequence
        that was sampled, so it stays out of the loss (``sample_mask`` 0)."""
        return self.failure is None and not self.noncontiguous

    @property
    def response_length(self) -> int:
        return int(sum(self.loss_mask))

    def append(
        self, ids: Sequence[int], *, generated: bool, logprobs: Sequence[float] | None = None
    ) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1.0 if generated else 0.0] * len(ids))
        self.gen_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def record_routing(self, experts: Any, weights: Any = None) -> None:
        """Add the engine's routing of the turn just appended (its prompt and generation:
        :attr:`~nrl_core.interfaces.GenerationOutput.routed_experts` and
        ``routing_weights`` of this sample; :func:`nrl_core.moe.merge_routing`)."""
        length = len(self.token_ids)
        old = self.routed_experts
        if weights is not None and (old is None or self.routing_weights is not None):
            new_weights = routing_weight_array(weights, length)
            self.routing_weights = merge_routing(self.routing_weights, new_weights, old)
        else:  # weights only when every turn gave them
            self.routing_weights = None
        self.routed_experts = merge_routing(old, routing_array(experts, length))


def start_episodes(samples: Sequence[Sample], codec: ChatCodec, repeats: int) -> list[Episode]:
    """``repeats`` episodes per sample (a GRPO group each), prompts encoded once."""
    episodes = []
    for group, sample in enumerate(samples):
        messages = codec.prompt_messages(sample)
        ids = codec.encode_prompt(messages)
        metadata = {**sample.metadata, "answer": sample.answer, "task": sample.task}
        for _ in range(repeats):
            episodes.append(
                Episode(
                    group=group,
                    task=sample.task,
                    messages=[dict(m) for m in messages],
                    metadata=dict(metadata),
                    token_ids=list(ids),
                    prompt_length=len(ids),
                )
            )
    return episodes


def rollout(
    episodes: list[Episode],
    generate: GenerateFn,
    env_pool: Any,
    codec: ChatCodec,
    params: SamplingParams,
    *,
    max_turns: int,
    max_total_length: int,
    max_tokens_per_call: int = 0,
) -> list[Episode]:
    """Roll ``episodes`` out in place until every one is done; returns them.

    Partial rollouts (``max_tokens_per_call`` > 0): no episode generates more than that many
    tokens in this call; one that reaches it before its turn is over (a stop, the turn's
    ``params.max_new_tokens``, the sequence budget) stays not ``done``, marked ``partial``,
    with ``turn_tokens`` generated, and a later ``rollout`` of it continues the turn: its
    prompt is its ``token_ids`` so far (exactly the ids generated, as between turns), its
    budget what is left of ``max_new_tokens``, the continuation is appended to the same
    assistant message, and the environment sees the turn only once it is over. Episodes
    continued and episodes starting may share one call.

    No episode grows past ``max_total_length`` tokens: generation is cut to the budget left,
    an observation that would fill it ends the episode, and an episode with no budget left
    (a prompt at or over the limit) ends as truncated without generating; its prompt is cut
    to the limit so the training batch stays within it (it has no generated token, so it
    carries no loss either way). Without an environment (``env_pool`` None) every episode
    ends after its first turn with reward 0.
    """
    paused: set[int] = set()  # episodes cut by max_tokens_per_call in this call
    while True:
        for episode in episodes:
            if not episode.done and len(episode.token_ids) >= max_total_length:
                _end_over_budget(episode, max_total_length)
        active = [e for e in episodes if not e.done and id(e) not in paused]
        if not active:
            break
        # What each episode may generate now: the rest of its turn, at most the per-call cap.
        limits = [params.max_new_tokens - e.turn_tokens for e in active]
        if max_tokens_per_call > 0:
            limits = [min(limit, max_tokens_per_call) for limit in limits]
        call_params = params
        if max(limits) != params.max_new_tokens:
            call_params = attrs.evolve(params, max_new_tokens=max(limits))
        output = generate(
            [e.token_ids for e in active],
            call_params,
            [list(e.stop_strings) if e.stop_strings else None for e in active],
        )
        ended: list[Episode] = []  # whose turn is over
        for index, (episode, ids, logprobs, reason) in enumerate(
            zip(active, output.token_ids, output.logprobs, output.finish_reasons, strict=True)
        ):
            budget = max_total_length - len(episode.token_ids)  # >= 1: checked above
            if len(ids) > budget:
                ids, logprobs, reason = ids[:budget], logprobs[:budget], "length"
            if len(ids) > limits[index]:  # the call's limit is the largest of the episodes'
                ids, logprobs, reason = ids[: limits[index]], logprobs[: limits[index]], "length"
            continued = episode.turn_tokens > 0
            episode.append(ids, generated=True, logprobs=logprobs)
            episode.turn_tokens += len(ids)
            if output.weight_versions is not None:
                episode.weight_versions.extend(output.weight_versions[index][: len(ids)])
            if output.routed_experts is not None:
                weights = output.routing_weights
                episode.record_routing(
                    output.routed_experts[index], None if weights is None else weights[index]
                )
            if continued:  # the same turn: one assistant message, its ids spliced on
                message = episode.messages[-1]
                message["token_ids"] = [*message["token_ids"], *ids]
                message["content"] = codec.decode(message["token_ids"])
            else:
                episode.messages.append(
                    {"role": "assistant", "content": codec.decode(ids), "token_ids": list(ids)}
                )
            episode.finish_reason = reason
            episode.truncated = len(episode.token_ids) >= max_total_length
            if (
                max_tokens_per_call > 0
                and reason == "length"
                and not episode.truncated
                and episode.turn_tokens < params.max_new_tokens
            ):
                episode.partial = True  # cut by the call, not by the turn: continued later
                paused.add(id(episode))
                continue
            episode.turn_tokens = 0
            episode.turns += 1
            ended.append(episode)
        if not ended:
            continue
        if env_pool is None:  # no environment (distillation): one turn, nothing scored
            for episode in ended:
                episode.done = True
            continue
        results = env_pool.step(
            [e.task for e in ended],
            [[{"role": m["role"], "content": m["content"]} for m in e.messages] for e in ended],
            [e.metadata for e in ended],
        )
        for episode, result in zip(ended, results, strict=True):
            episode.reward += result.reward
            if result.error is not None:
                episode.env_errors += 1
            failure = failure_of(result)
            if failure is not None and episode.env_failure is None:
                episode.env_failure = failure
            if result.step.metadata is not None:
                episode.metadata = dict(result.step.metadata)
            observation = result.step.observation
            if (
                result.step.terminated
                or observation is None
                or episode.turns >= max_turns
                or episode.truncated
            ):
                episode.done = True
                continue
            obs_ids = codec.encode_observation(episode.messages, observation)
            if len(episode.token_ids) + len(obs_ids) >= max_total_length:
                episode.done, episode.truncated = True, True
                continue
            episode.append(obs_ids, generated=False)
            episode.messages.append({**observation, "token_ids": obs_ids})
            episode.stop_strings = result.step.stop_strings
    return episodes


def apply_trajectory(
    episode: Episode, trajectory: Trajectory, codec: ChatCodec, *, max_total_length: int
) -> Episode:
    """Fill ``episode`` (started by :func:`start_episodes`) from an agent's ``trajectory``.

    The training sequence is the first call's prompt, then, for every call, the ids of its
    prompt that are new (tool results, the next user turn: no loss) and its generated ids (with
    loss and their sampling logprobs). A call whose prompt does not start with the ids so far
    marks the episode ``noncontiguous``: the ids the model saw are not one sequence, so no
    training sequence is the one that was sampled; it keeps the calls before it and is masked
    out of the loss. A failed row (``failure_reason``) keeps the sample's prompt and nothing
    else, with reward 0; so does a trajectory holding an id outside the model's vocabulary
    (``codec.vocab_size``; the endpoint's own check, :func:`~nrl_core.data.token_id_problem`: such an id cannot be
    decoded or trained on), its failure naming the call and the id. A sequence longer than
    ``max_total_length`` is cut there (truncated).
    """
    episode.reward = float(trajectory.reward)
    episode.finish_reason = trajectory.finish_reason
    episode.done = True
    episode.turns = len(trajectory.calls)
    episode.agent_metrics = dict(getattr(trajectory, "metrics", None) or {})
    if trajectory.failure_reason is not None or not trajectory.calls:
        return _failed(episode, trajectory.failure_reason or "the agent made no model call")
    # An id outside the vocabulary cannot be decoded or trained on: the row fails. Only the
    # ids that enter the sequence are checked, each once (later prompts repeat the prefix).
    vocab = codec.vocab_size
    first = trajectory.calls[0].prompt_token_ids
    problem = token_id_problem(first, "model call 0's prompt_token_ids", vocab)
    if problem is not None:
        return _failed(episode, problem)
    sample = (list(episode.token_ids), episode.prompt_length, list(episode.messages))
    episode.token_ids, episode.prompt_length = list(first), len(first)
    episode.loss_mask, episode.gen_logprobs = [0.0] * len(first), [0.0] * len(first)
    for index, call in enumerate(trajectory.calls):
        prompt = call.prompt_token_ids
        seen = len(episode.token_ids)
        if prompt[:seen] != episode.token_ids:
            episode.noncontiguous = True
            break
        problem = token_id_problem(
            prompt[seen:], f"model call {index}'s prompt_token_ids", vocab
        ) or token_id_problem(
            call.generation_token_ids, f"model call {index}'s generation_token_ids", vocab
        )
        if problem is not None:
            episode.token_ids, episode.prompt_length, episode.messages = sample
            episode.loss_mask = [0.0] * len(episode.token_ids)
            episode.gen_logprobs = [0.0] * len(episode.token_ids)
            return _failed(episode, problem)
        if len(prompt) > seen:
            new = prompt[seen:]
            episode.append(new, generated=False)
            episode.messages.append({"role": "context", "content": codec.decode(new)})
        episode.append(
            call.generation_token_ids, generated=True, logprobs=call.generation_log_probs
        )
        episode.messages.append(
            {"role": "assistant", "content": codec.decode(call.generation_token_ids)}
        )
    if len(episode.token_ids) > max_total_length:
        del episode.token_ids[max_total_length:]
        del episode.loss_mask[max_total_length:]
        del episode.gen_logprobs[max_total_length:]
        episode.truncated, episode.finish_reason = True, "length"
    return episode


def _failed(episode: Episode, reason: str) -> Episode:
    """``episode`` as a failed row: masked out of the loss, reward 0."""
    episode.failure, episode.reward = reason, 0.0
    return episode


def _end_over_budget(episode: Episode, max_total_length: int) -> None:
    """End an episode that has no token of budget left, as truncated by the length limit."""
    if len(episode.token_ids) > max_total_length:
        # Only a prompt can be over the limit (later turns are cut to the budget), so only
        # masked prompt ids are dropped here.
        del episode.token_ids[max_total_length:]
        del episode.loss_mask[max_total_length:]
        del episode.gen_logprobs[max_total_length:]
        if episode.routed_experts is not None:
            episode.routed_experts = episode.routed_experts[:max_total_length]
        if episode.routing_weights is not None:
            episode.routing_weights = episode.routing_weights[:max_total_length]
        episode.prompt_length = min(episode.prompt_length, max_total_length)
    episode.done = episode.truncated = True
    episode.finish_reason = "length"


def episodes_to_batch(
    episodes: Sequence[Episode], advantages: torch.Tensor, pad_token_id: int
) -> Batch:
    """The training batch: ids, masks, generation logprobs and per-token advantages."""
    input_ids = pad_sequences([e.token_ids for e in episodes], pad_value=pad_token_id)
    loss_mask = pad_sequences([e.loss_mask for e in episodes], dtype=torch.float32)
    for row, episode in enumerate(episodes):
        if episode.loss_excluded:
            loss_mask[row, episode.loss_excluded] = 0.0
    gen_logprobs = pad_sequences([e.gen_logprobs for e in episodes], dtype=torch.float32)
    tensors = {
        "input_ids": input_ids,
        "lengths": torch.tensor([len(e.token_ids) for e in episodes], dtype=torch.long),
        "loss_mask": loss_mask,
        "gen_logprobs": gen_logprobs,
        "advantages": advantages.float()[:, None] * loss_mask,
        "sample_mask": torch.tensor([float(e.trainable) for e in episodes]),
    }
    routed = routed_experts_tensor(episodes, input_ids.shape[1])
    if routed is not None:
        tensors[ROUTED_EXPERTS] = routed
        if all(e.routing_weights is not None for e in episodes):
            weights = torch.zeros(routed.shape, dtype=torch.float32)
            for row, episode in enumerate(episodes):
                n = min(routed.shape[1], episode.routing_weights.shape[0])
                weights[row, :n] = episode.routing_weights[:n]
            tensors[ROUTING_WEIGHTS] = weights
    return Batch(tensors, [{"group": e.group, "task": e.task} for e in episodes])


def routed_experts_tensor(episodes: Sequence[Episode], width: int) -> torch.Tensor | None:
    """The episodes' engine routing as one int16 ``[B, width, layers, k]``
    (:data:`nrl_core.data.ROUTED_EXPERTS`; padding and unrecorded episodes
    :data:`~nrl_core.data.NOT_RECORDED`), or None when no episode has any."""
    recorded = [e.routed_experts for e in episodes if e.routed_experts is not None]
    if not recorded:
        return None
    out = torch.full(
        (len(episodes), width, *recorded[0].shape[1:]), NOT_RECORDED, dtype=torch.int16
    )
    for row, episode in enumerate(episodes):
        if episode.routed_experts is not None:
            n = min(width, episode.routed_experts.shape[0])
            out[row, :n] = episode.routed_experts[:n]
    return out
