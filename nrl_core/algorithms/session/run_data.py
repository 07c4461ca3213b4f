"""The run's data: the driver's tokenizer and chat codec, the training and validation splits
(one dataset, or the tasks of ``data.tasks`` drawn by weight), and the prompt length filter,
all checked before Ray or any worker starts."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

from nrl_core.agents import BUILTIN_AGENT
from nrl_core.algorithms.rollout import ChatCodec
from nrl_core.config.schema import RunConfig
from nrl_core.datasets import (
    DataStream,
    MixedStream,
    PromptLengthFilter,
    load_splits,
    load_task_splits,
)
from nrl_core.errors import ConfigError
from nrl_core.interfaces import ComponentContext
from nrl_core.registry import Registry


def resolve_model_name(name: str) -> str:
    """``tiny`` is the locally built test model; anything else is a hub name or a folder."""
    from nrl_core.testing.tiny import resolve_model_name as resolve

    return str(resolve(name))


class RunData:
    """What the run trains and validates on, loaded by :meth:`load`.

    Args:
        config, registry, context: the run's; algorithm: the algorithm running.
        console: the run's console (a quiet one silences the dropped-prompt warning).
    """

    def __init__(
        self,
        config: RunConfig,
        registry: Registry,
        context: ComponentContext,
        *,
        algorithm: str,
        console: Console,
    ) -> None:
        self.config = config
        self.registry = registry
        self.context = context
        self.algorithm = algorithm
        self.console = console
        self.tokenizer: Any = None
        self.codec: ChatCodec | None = None
        self.val_samples: list = []
        self.train_stream: DataStream | None = None
        self.task_agents: dict[str, str] = {}
        """Task name -> the agent that drives its rollouts (tasks not listed: ``agent.name``)."""
        self.data_metrics: dict[str, float] = {}
        """Counts from loading the data (prompts dropped as too long), logged at step 0."""

    def load(self) -> None:
        """The tokenizer, the chat codec and the train / validation samples.

        For GRPO, prompts that leave fewer than ``generation.max_new_tokens`` tokens before
        ``policy.max_total_sequence_length`` are dropped (see
        :class:`~nrl_core.datasets.PromptLengthFilter`), with a one-line warning, and counted
        in :attr:`data_metrics`: ``data/prompts_dropped_overlong`` for the training split and
        ``data/val_prompts_dropped_overlong`` for validation. A training split with no prompt
        left is a :class:`~nrl_core.errors.ConfigError`.
        """
        config = self.config
        prompt_filter = None
        if hasattr(config, "grpo") and hasattr(config, "generation"):
            longest = config.policy.max_total_sequence_length - config.generation.max_new_tokens
            prompt_filter = PromptLengthFilter(
                lambda samples: self.chat_codec().prompt_lengths(samples, longest=longest),
                longest,
            )
        if config.data.tasks:
            self._load_tasks(prompt_filter)
            return
        # The rows first: a bad data file is reported before transformers is even imported.
        train, self.val_samples = load_splits(
            config.data, self.registry, self.context, prompt_filter=prompt_filter
        )
        self.chat_codec()
        if prompt_filter is not None:
            self._report_dropped_prompts(prompt_filter, train)
        self.check_warmup_answers(train)
        self.train_stream = DataStream(train, seed=config.seed, shuffle=config.data.shuffle)

    def check_warmup_answers(self, train: list) -> None:
        """A warm-up (``grpo.sft_warmup_steps``, ``distill.teacher_warmup_steps``) trains on
        the training samples' answers: a sample without one would be trained to say "None"."""
        missing = sum(sample.answer is None for sample in train)
        for section, key in (("grpo", "sft_warmup_steps"), ("distill", "teacher_warmup_steps")):
            steps = getattr(getattr(self.config, section, None), key, 0)
            if steps and missing:
                raise ConfigError(
                    f"{section}.{key}={steps} trains on the samples' answers, but {missing} of "
                    f"{len(train)} training samples have none; set {section}.{key}=0 or give "
                    "every sample an answer (data.prompts.require_answer=true finds them)"
                )

    def _load_tasks(self, prompt_filter: PromptLengthFilter | None) -> None:
        """``data.tasks``: every task's samples, one stream per task drawn by weight
        (:class:`~nrl_core.datasets.MixedStream`), validation = every task's validation
        samples; the environment and agent each task names are checked here, before Ray."""
        config = self.config
        for index, task in enumerate(config.data.tasks):
            agent = task.agent or getattr(getattr(config, "agent", None), "name", BUILTIN_AGENT)
            self.registry.get("agent", agent, key=f"data.tasks[{index}].agent")
            if agent != BUILTIN_AGENT and not hasattr(config, "agent"):
                raise ConfigError(
                    f"data.tasks[{index}].agent={agent}: agents drive rollouts in `nrl run grpo` "
                    f"only; `nrl {self.algorithm}` rolls out with the core's loop (agent: env)"
                )
            if agent == BUILTIN_AGENT and task.agent_configs:
                raise ConfigError(
                    f"data.tasks[{index}].agent_configs is for a task driven by a registered "
                    f"agent (e.g. agent: nemo_gym), but task {task.name!r} uses the core's loop "
                    "(agent: env); set its agent or remove agent_configs"
                )
            if agent == BUILTIN_AGENT and hasattr(config, "env"):
                env = task.env or config.env.name
                self.registry.get("environment", env, key=f"data.tasks[{index}].env")
            self.task_agents[task.name] = agent
        splits = load_task_splits(
            config.data, self.registry, self.context, prompt_filter=prompt_filter
        )
        self.chat_codec()
        train = [s for task_train, _ in splits.values() for s in task_train]
        if prompt_filter is not None:
            self._report_dropped_prompts(prompt_filter, train)
        self.check_warmup_answers(train)
        for name, (task_train, _) in splits.items():
            if not task_train:
                raise ConfigError(
                    f"task {name!r} of data.tasks has no training prompt that fits "
                    "policy.max_total_sequence_length; raise it or lower "
                    "generation.max_new_tokens"
                )
        self.val_samples = [s for _, val in splits.values() for s in val]
        self.train_stream = MixedStream(
            {
                name: DataStream(task_train, seed=config.seed, shuffle=config.data.shuffle)
                for name, (task_train, _) in splits.items()
            },
            {task.name: task.weight for task in config.data.tasks},
            seed=config.seed,
        )

    def chat_codec(self) -> ChatCodec:
        """The driver's tokenizer and chat codec, loaded on first use."""
        if self.codec is None:
            from transformers import AutoTokenizer

            policy = self.config.policy
            model_path = resolve_model_name(policy.model_name)
            tokenizer_path = resolve_model_name(policy.tokenizer_name or model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            from nrl_core.memory_plan import _model_config

            # The model may embed more ids than the tokenizer names (padded embeddings): an
            # agent's trajectory may hold sampled ids up to the model's vocab_size. Preflight
            # has read the same config.json (the memory plan).
            try:
                vocab_size = (_model_config(model_path) or {}).get("vocab_size")
            except RecursionError:
                vocab_size = None
            self.codec = ChatCodec(
                self.tokenizer,
                apply_chat_template=self.config.data.apply_chat_template,
                system_prompt=self.config.data.system_prompt,
                vocab_size=vocab_size if isinstance(vocab_size, int) else None,
            )
            # One message through the template now, in the driver: a template jinja2's
            # sandbox refuses is bad input (one line), not a failure once training renders.
            # Another error of the template (its own raise_exception on this made-up message)
            # is left to the real samples, which say which row.
            try:
                self.codec.encode_prompt([{"role": "user", "content": "1+1"}])
            except ConfigError:
                raise
            except Exception:
                pass
        return self.codec

    def check_teacher_tokenizer(self) -> None:
        """Distillation compares teacher and student token by token: their tokenizers must map
        the same strings to the same ids (one line naming both models otherwise)."""
        from transformers import AutoTokenizer

        teacher, policy = self.config.teacher, self.config.policy
        path = resolve_model_name(teacher.tokenizer_name or teacher.model_name)
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
        ours = self.tokenizer.get_vocab()
        if theirs == ours:
            return
        differs = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
        token = differs[0][0] if differs else "?"
        raise ConfigError(
            f"teacher.model_name={teacher.model_name} and policy.model_name={policy.model_name} "
            f"do not share a tokenizer ({len(theirs)} vs {len(ours)} tokens; {token!r} differs): "
            "distillation compares the two models token by token, so pick a teacher and a "
            "student of one tokenizer family"
        )

    def _report_dropped_prompts(self, prompt_filter: PromptLengthFilter, train: list) -> None:
        """Fail when no training prompt fits, warn when some were dropped, keep the counts."""
        config = self.config
        limit = (
            f"policy.max_total_sequence_length={config.policy.max_total_sequence_length} minus "
            f"generation.max_new_tokens={config.generation.max_new_tokens}"
        )
        dropped = prompt_filter.dropped.get("train", 0)
        val_dropped = prompt_filter.dropped.get("validation", 0)
        if not train:
            raise ConfigError(
                f"every one of the {prompt_filter.total.get('train', 0)} training prompts of "
                f"data.dataset={config.data.dataset} is longer than "
                f"{prompt_filter.max_prompt_length} tokens ({limit}; the shortest has "
                f"{prompt_filter.shortest.get('train', 0)}); raise "
                "policy.max_total_sequence_length or lower generation.max_new_tokens"
            )
        self.data_metrics = {
            "data/prompts_dropped_overlong": float(dropped),
            "data/val_prompts_dropped_overlong": float(val_dropped),
        }
        if (dropped or val_dropped) and not self.console.quiet:
            print(
                f"warning: dropped {dropped} of {prompt_filter.total.get('train', 0)} training "
                f"and {val_dropped} of {prompt_filter.total.get('validation', 0)} validation "
                f"prompts longer than {prompt_filter.max_prompt_length} tokens ({limit}); raise "
                "policy.max_total_sequence_length to keep them",
                file=sys.stderr,
            )

    def line(self) -> str:
        """``data: 2048 training, 64 validation prompts`` (and the tasks of ``data.tasks``)."""
        stream = self.train_stream
        streams = getattr(stream, "streams", None) or {"": stream}
        train = sum(len(getattr(s, "samples", ())) for s in streams.values())
        tasks = f" of {len(streams)} tasks" if len(streams) > 1 else ""
        what = "examples" if not hasattr(self.config, "generation") else "prompts"
        return f"data: {train} training, {len(self.val_samples)} validation {what}{tasks}"

    def agent_for(self, task: str) -> str:
        """The agent that drives ``task``'s rollouts (``data.tasks[i].agent``, else
        ``agent.name``; ``env`` is the core's own loop)."""
        return self.task_agents.get(task) or getattr(
            getattr(self.config, "agent", None), "name", BUILTIN_AGENT
        )
