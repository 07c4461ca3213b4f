"""The driver's view of separate generation engines (vLLM, SGLang): one object over a worker
group of engine actors, as :class:`nrl_core.policy.Policy` is for the policy ranks.

* ``generate`` splits the prompts into contiguous, even shards, one per engine (data
  parallel), and concatenates the answers in prompt order.
* ``refit`` pushes the policy's current weights into every engine through
  :class:`nrl_core.weight_sync.WeightSender`, run by the policy ranks (``push_weights``), and
  returns the seconds it took; :attr:`last_refit` keeps the bytes and bucket count.
* colocated engines sleep when the policy needs its GPU again (:meth:`GenerationEngines.release`,
  run by :meth:`nrl_core.policy.Policy.onload` before the policy's next call: logprobs,
  training, a checkpoint), not after each ``generate``: the turns of a multi-turn rollout, the
  rounds of dynamic sampling and the requests of ``nrl serve`` all generate on the weights of
  one refit. They wake on the next refit (weights) and ``generate`` (KV cache). The policy
  hands its GPU memory over around them: optimizer state to CPU before a refit, weights to CPU
  after it (the engine then allocates its KV cache), both back before the policy's next call
  (:meth:`nrl_core.policy.Policy.offload` / ``onload``). A sleep that drops the weights (vLLM
  level 2, SGLang without a weight backup) clears :attr:`GenerationEngines.holds_weights`:
  the next generate must follow a refit (the :class:`~nrl_core.algorithms.async_grpo.WeightGate`
  refits then even for the same version).

Each engine is ONE Ray actor (rank 0 of its tensor-parallel group); the engine spawns its own
tensor-parallel workers inside that actor's GPUs, so ``WorkerGroup`` ranks here are engines.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

# The engine plugins' options extend this base (it lives with the config schema: import-light).
from nrl_core.config.schema.generation import EngineOptions as EngineOptions
from nrl_core.config.validation import nccl_colocated_message
from nrl_core.data import split_even
from nrl_core.distributed.errors import EngineReplacedError, WorkerError
from nrl_core.distributed.worker_group import Sharded, WorkerGroup
from nrl_core.errors import ConfigError, NrlError
from nrl_core.interfaces import GenerationOutput, SamplingParams
from nrl_core.run_log import LOGGER_NAME
from nrl_core.weight_sync import CHECKPOINT, NameMap, RefitStats, WeightSender

COLOCATED_SHARE = 0.5
"""The share of each GPU bundle that the policy and its colocated engines each ask for: the two
requests fill the bundle together, so Ray schedules both and narrows both actors'
``CUDA_VISIBLE_DEVICES`` to the same GPU. (A policy actor asking for the whole GPU would leave
nothing for the engine, which would then wait for resources until the worker timeout.)"""


IN_FLIGHT_CONCURRENCY = 16
"""Calls each engine actor runs at once with in-flight refits (``in_flight=True``): the
producer's overlapping generate calls, the endpoint's, and the refit's weight-sync calls, which
must reach an engine while it generates (a threaded actor; idle threads cost nothing)."""


ENGINE_CPUS_ON_CPU = 0.5
"""The CPU share each separate engine asks for on a CPU-only cluster; the policy ranks leave it
room (they share the cores as the engines and environments do)."""


def runs_in_policy_workers(spec: Any, generation: Any) -> bool:
    """Whether generation runs inside the policy workers from the policy's own weights (no
    engines, no refit): a backend registered with ``colocated=True`` (``torch``) whose options
    do not ask for separate engines (``generation.torch.colocated=false``)."""
    if not spec.metadata.get("colocated"):
        return False
    return bool(getattr(generation.options_for(), "colocated", True))


def engines_colocated(generation: Any, *, on_gpu: bool) -> bool:
    """Whether the separate engines of a ``generation`` config section share the policy's GPUs
    (their ``colocated`` option, on a GPU cluster: on CPU there is nothing to share)."""
    options = generation.options_for()
    return bool(getattr(options, "colocated", False)) and on_gpu


def engines_sleep(generation: Any, *, on_gpu: bool) -> bool:
    """Whether the core drives the sleep/wake hand-off of the engines: colocated on GPUs, and
    ``colocated`` engines on CPU under the memory contract's emulation (``NRL_MEMORY_CONTRACT=1``,
    :mod:`nrl_core.memory_contract`), which run the GPU path's calls without sharing anything."""
    from nrl_core import memory_contract

    if engines_colocated(generation, on_gpu=on_gpu):
        return True
    options = generation.options_for()
    return bool(getattr(options, "colocated", False)) and memory_contract.enabled()


def resolve_transport(
    configured: str, *, colocated: bool, on_gpu: bool, section: str = "generation"
) -> str:
    """The refit transport for ``refit_transport`` (``auto``: ``cuda_ipc`` when colocated on
    GPUs, ``nccl`` on separate GPUs, ``shm`` on CPU). ``nccl`` between colocated engines and
    the policy on GPUs is refused (``ConfigError``): policy rank 0 and engine 0 share a GPU,
    and NCCL refuses two ranks of one group on one device ("Duplicate GPU detected").
    ``section`` names the options' key in the message (``generation.vllm``)."""
    if configured != "auto":
        if configured not in ("shm", "cuda_ipc", "nccl"):
            raise ConfigError(f"refit_transport={configured!r}; use auto, shm, cuda_ipc or nccl")
        if configured == "nccl" and colocated and on_gpu:
            raise ConfigError(nccl_colocated_message(section))
        return configured
    if not on_gpu:
        return "shm"
    return "cuda_ipc" if colocated else "nccl"


MAX_ENGINE_REPLACEMENTS = 3
"""The most dead engines a run replaces (``grpo.async.replace_dead_engines``); the next dead
one is the run's error, so a crash loop ends instead of restarting engines for ever."""


class GenerationEngines:
    """Separate generation engines behind ``generate`` and ``refit``.

    Args:
        group: one actor per engine, each running the plugin's generation worker (which
            implements ``generate``, ``sleep`` and :class:`nrl_core.interfaces.WeightSync`).
        transport: the refit transport (see :func:`resolve_transport`).
        bucket_bytes: size bound of each refit bucket.
        dtype: the engines' weight dtype (refit casts floating tensors to it), or None.
        colocated: engines share GPUs with the policy: they sleep whenever the policy takes
            its GPU back (:meth:`release`), and on CPU with ``NRL_MEMORY_CONTRACT=1`` (the
            same calls, against engines that emulate sleep mode; see
            :mod:`nrl_core.memory_contract`).
        name_map: policy-to-engine parameter names (None: identical, as for dtensor + HF).
        nccl_per_tensor: see :class:`~nrl_core.weight_sync.WeightSender`.
        layout: the weight layout the engines load (their options' ``weight_layout``).
        lora_refit: for a LoRA policy, ``"adapters"`` (each refit sends only the adapter
            tensors: :meth:`refit`) or ``"merged"``; None without LoRA (see
            :func:`nrl_core.weight_sync.adapters.lora_refit_mode`).
        in_flight: refits may land while a ``generate`` call is in flight
            (``grpo.async.in_flight_weight_updates``): ``generate`` holds the state lock only
            to check and shard, not for the call, so a :meth:`refit` runs meanwhile; the
            engines (threaded actors, :data:`IN_FLIGHT_CONCURRENCY`) swap the weights in
            between two decode steps and record each token's version, which :meth:`refit`
            announces to them first (``expect_weight_version``). Separate engines only: a
            colocated engine shares the policy's GPU and sleeps around it.
    """

    def __init__(
        self,
        group: WorkerGroup,
        *,
        transport: str = "shm",
        bucket_bytes: int = 512 << 20,
        dtype: str | None = None,
        colocated: bool = False,
        name_map: NameMap | None = None,
        nccl_per_tensor: bool = False,
        layout: str = CHECKPOINT,
        lora_refit: str | None = None,
        in_flight: bool = False,
    ) -> None:
        if in_flight and colocated:
            raise ConfigError(
                "in-flight refits need separate engines; colocated ones hand the GPU back and "
                "forth with the policy (set grpo.async.in_flight_weight_updates=false)"
            )
        self.group = group
        self.in_flight = in_flight
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.colocated = colocated
        self.name_map = name_map
        self.nccl_per_tensor = nccl_per_tensor
        self.layout = layout
        self.lora_refit = lora_refit
        self.adapter_version = 0
        """The version of the last adapter sent (adapter refits: one more each refit)."""
        self.last_refit: RefitStats | None = None
        self._nccl_ready = False
        self.tp_size = 1
        self._policy: Any = None  # the policy last refitted from: it yields its GPU memory
        # Colocated engines sleep at start-up (the policy starts on the GPU next).
        self.awake = not colocated
        """Whether the engines hold GPU memory now (colocated: between a refit or generate
        and the next :meth:`release`)."""
        self.holds_weights = not colocated
        """Whether the engines hold the weights of their last refit (or, separate engines,
        the model folder they loaded): False after a sleep that dropped them, until the next
        refit. Colocated engines start asleep, so a refit must come first."""
        self.max_replacements = 0
        """How many dead engines :meth:`generate` may replace in this run (>= 0; 0: a dead
        engine is the run's error; ``grpo.async.replace_dead_engines`` sets
        :data:`MAX_ENGINE_REPLACEMENTS`)."""
        self.replaced = 0
        """Engines replaced so far."""
        self._epoch = 0  # one more per replacement: calls that failed before it just retry
        # A server thread (``nrl serve``, the agents' endpoint) may generate while the driver
        # refits or releases: the state above changes under this lock only.
        self._lock = threading.RLock()

    @property
    def num_engines(self) -> int:
        return self.group.num_workers

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue every prompt; engine ``i`` gets the ``i``-th contiguous shard.

        Colocated engines stay awake afterwards (the next turn, round or request generates
        on the same weights); they sleep when the policy takes its GPU back (:meth:`release`).
        Refuses, before calling any engine, when a sleep dropped their weights and no refit
        followed: a GPU engine would generate from undefined memory."""
        try:
            with self._lock:
                epoch = self._epoch
                if not self.holds_weights and self.replaced and not self.colocated:
                    # Another call's dead engine was replaced after this call was admitted:
                    # like that call, this one runs again once the trainer refitted the new
                    # engine (the producer waits for it).
                    raise EngineReplacedError(f"{self.group.name}: an engine was replaced")
                if not self.holds_weights:
                    raise NrlError(
                        "the generation engines do not hold weights (colocated ones dropped "
                        "them when they last slept, or a dead engine was replaced) and were not "
                        "refitted since; the caller must refit before generating "
                        "(WeightGate.ensure does when holds_weights is False)"
                    )
                if self.colocated and self._policy is not None:
                    # The engines allocate their KV cache now: the policy's memory must be free.
                    self._policy.offload(["optimizer", "weights"])
                n = self.num_engines
                prompt_shards = split_even(list(prompts), n)
                stops = list(stop_strings) if stop_strings is not None else [None] * len(prompts)
                self.awake = True  # set first: a failed call may have woken some engines
                if not self.in_flight:
                    parts = self.group.run_sharded(
                        "generate", prompt_shards, params, Sharded(split_even(stops, n))
                    )
            if self.in_flight:
                # Separate engines, no sleep: nothing above changes under the call, and a
                # refit must be able to take the lock while it runs.
                parts = self.group.run_sharded(
                    "generate", prompt_shards, params, Sharded(split_even(stops, n))
                )
        except WorkerError as exc:
            if self.max_replacements > 0:
                self._replace_dead(epoch, exc)
            raise
        return GenerationOutput.concat(parts)

    def _replace_dead(self, epoch: int, exc: WorkerError) -> None:
        """After a generate call failed with ``exc``: when an engine's actor is dead and
        replacements are left, start a new one in its place and raise
        :class:`EngineReplacedError` (the caller generates the call again after a refit); when
        another call replaced it since this one started (``epoch``), raise that too. Returns
        (the caller raises ``exc``) when no engine is dead; past :attr:`max_replacements` the
        dead engine's error is raised."""
        with self._lock:
            if self._epoch != epoch:
                raise EngineReplacedError(f"{self.group.name}: an engine was replaced") from exc
            dead = self.group.dead_rank_error("generate")
            if dead is None:
                return
            line = self._replace(dead, exc)
            raise EngineReplacedError(line) from exc

    def _replace(self, dead: WorkerError, exc: BaseException) -> str:
        """Start a new engine in place of the dead one of ``dead`` (lock held), or raise
        ``dead`` when no replacement is left; returns the warning line it printed."""
        if self.replaced >= self.max_replacements:
            if self.max_replacements == 0:
                raise dead from exc
            raise NrlError(
                f"{dead} (replaced {self.replaced} dead engines already, the most a run may: "
                "nrl_core.generation.MAX_ENGINE_REPLACEMENTS)"
            ) from exc
        if self.transport == "nccl":
            # The new engine would have to join the refit's NCCL group, formed once by all.
            raise NrlError(
                f"{dead} (grpo.async.replace_dead_engines cannot replace engines refitted over "
                "NCCL yet)"
            ) from exc
        self.holds_weights = False  # the new engine holds the model folder's weights
        self._nccl_ready = False
        self.group.replace_rank(dead.rank)
        self.replaced += 1
        self._epoch += 1
        line = (
            f"warning: {dead}; started a new engine in its place ({self.replaced} of at most "
            f"{self.max_replacements} replacements), refitting it and generating the failed "
            "calls again"
        )
        print(line, file=sys.stderr, flush=True)
        logging.getLogger(LOGGER_NAME).warning(line)
        return line

    def sender(self) -> WeightSender:
        """The :class:`WeightSender` that the policy ranks run to reach these engines."""
        from nrl_core.weight_sync.adapters import ADAPTERS

        return WeightSender(
            receivers=list(self.group.actors),
            transport=self.transport,
            name_map=self.name_map,
            dtype=self.dtype,
            nccl_per_tensor=self.nccl_per_tensor,
            timeout_s=self.group.timeout_s,
            ipc_ranks=self.ipc_ranks(),
            layout=self.layout,
            # Engines that take adapters load the base weights without them.
            lora_weights="base" if self.lora_refit == ADAPTERS else "merged",
        )

    def ipc_ranks(self) -> frozenset[int] | None:
        """The policy ranks that share CUDA IPC handles: those whose GPU hosts an engine.
        Colocated engine ``e`` takes bundle ``e`` of the policy's placement group, which is
        policy rank ``e``'s GPU (one bundle per rank, :meth:`WorkerGroup.start`); separate
        engines sit on no policy GPU. None for the other transports."""
        if self.transport != "cuda_ipc":
            return None
        return frozenset(range(self.num_engines)) if self.colocated else frozenset()

    def refit(self, policy: Any, version: int | None = None) -> float:
        """Push ``policy``'s current weights (a :class:`nrl_core.policy.Policy` whose workers
        have ``push_weights(sender, bucket_bytes)``) into every engine; return the seconds.

        ``version`` (>= 0, optimizer steps in the weights; in-flight engines only): told to the
        engines before the push (``expect_weight_version``), so the tokens generated after the
        swap record it even when the swap lands mid-call.

        :attr:`last_refit` holds the full :class:`RefitStats`;
        ``last_refit.as_metrics()`` gives ``timing/refit_s`` and ``refit/bytes``.

        With ``lora_refit="adapters"`` the policy ranks' ``push_adapters(sender, version)``
        sends only the adapter tensors, onto the base weights the engines loaded; engines that
        do not hold them (colocated ones before their first refit, or after a sleep that
        dropped them) get the base weights first, and :attr:`last_refit` then counts both.
        """
        with self._lock:
            if self.in_flight and version is not None:
                try:
                    self.group.run_all("expect_weight_version", int(version))
                except WorkerError as exc:
                    dead = self.group.dead_rank_error("refit")
                    if dead is None:
                        raise
                    self._replace(dead, exc)  # raises `dead` unless replacements are left
                    self.group.run_all("expect_weight_version", int(version))
            return self._refit(policy)

    def _refit(self, policy: Any) -> float:
        if self.transport == "nccl" and not self._nccl_ready:
            self._init_nccl(policy)
        if self.colocated:
            # The engines' weights come back next to the policy's: make room first.
            self._policy = policy
            policy.add_device_sharer(self.release)  # it sleeps us before taking the GPU back
            if "weights" in policy.offloaded:  # e.g. after a validation: the push needs them
                policy.onload()  # (which puts the engines to sleep first)
            policy.offload(["optimizer"])
            self.awake = True  # each engine wakes its weights for the refit
        had_weights = self.holds_weights
        self.holds_weights = False  # until every bucket arrived
        try:
            stats = self._push(policy, had_weights)
        except WorkerError as exc:
            # A dead engine shows up in the policy rank as a bare ActorDiedError: name the
            # engine, its pid and why it died instead.
            dead = self.group.dead_rank_error("refit")
            if dead is None:
                raise
            self._replace(dead, exc)  # raises `dead` unless replacements are on and left
            stats = self._push(policy, False)  # every engine again, the new one from scratch
        self.holds_weights = True
        if self.colocated:
            policy.offload(["weights"])
        self.last_refit = stats
        return stats.seconds

    def _push(self, policy: Any, had_weights: bool) -> RefitStats:
        from nrl_core.weight_sync.adapters import ADAPTERS

        def lead(results: list) -> RefitStats:
            stats = next((r for r in results if r is not None), None)
            if stats is None:
                raise RuntimeError("no policy rank reported refit statistics")
            return stats

        sender = self.sender()
        if self.lora_refit != ADAPTERS:
            return lead(policy.group.run_all("push_weights", sender, self.bucket_bytes))
        base = None
        if not had_weights:
            base = lead(policy.group.run_all("push_weights", sender, self.bucket_bytes))
        self.adapter_version += 1
        stats = lead(policy.group.run_all("push_adapters", sender, self.adapter_version))
        if base is None:
            return stats
        return RefitStats(
            base.seconds + stats.seconds,
            base.bytes + stats.bytes,
            base.buckets + stats.buckets,
            base.tensors + stats.tensors,
        )

    def release(self) -> None:
        """Put colocated engines to sleep, if awake: the policy is about to use its GPU
        (:meth:`nrl_core.policy.Policy.onload` calls this first). Each engine's ``sleep``
        returns True when its weights survive it (vLLM level 1, SGLang with a weight backup);
        otherwise :attr:`holds_weights` turns False and the next generate needs a refit.
        Nothing to do for separate engines, or engines already asleep."""
        with self._lock:
            if not self.colocated or not self.awake:
                return
            kept = self.group.run_all("sleep")
            self.awake = False
            if not all(k is True for k in kept):
                self.holds_weights = False

    def _init_nccl(self, policy: Any) -> None:
        """Form the refit group: policy rank 0 is rank 0, engine ``e``'s tensor-parallel workers
        take ranks ``1 + e * tp ..``. All members must join at once, hence the raw actor calls."""
        import ray

        lead = policy.group.actors[0]
        # Both groups on the driver's node: the refit store listens on loopback only.
        local = getattr(policy.group, "is_local", False) and getattr(self.group, "is_local", False)
        addr = "127.0.0.1" if local else policy.group.infos[0].node_ip or "127.0.0.1"
        port = ray.get(lead.free_port.remote(addr if local else ""))
        world = 1 + self.num_engines * self.tp_size
        name = "nrl-refit"
        refs = [lead.call.remote("init_weight_sync_group", (name, addr, port, 0, world), {})]
        refs += [
            actor.call.remote(
                "init_weight_sync_group", (name, addr, port, 1 + e * self.tp_size, world), {}
            )
            for e, actor in enumerate(self.group.actors)
        ]
        self.group._gather(refs, "init_weight_sync_group", ranks=[0] * len(refs))
        self._nccl_ready = True

    def shutdown(self) -> None:
        """Stop the engines (nothing to do, and no Ray call, once Ray itself is stopped: see
        :meth:`WorkerGroup.shutdown`)."""
        self.group.shutdown()


def start_generation_engines(
    spec: Any,
    config: Any,
    *,
    context: Any = None,
    shared_bundles: Any = None,
    on_gpu: bool,
    python: str | None = None,
    timeout_s: float = 600,
    in_flight: bool = False,
    env_vars: dict[str, str] | None = None,
) -> GenerationEngines:
    """Start the engines of ``config.generation`` (a plugin's ``generation.<name>`` options:
    ``num_engines``, ``tensor_parallel_size``, ``colocated``, ``refit_bucket_mb``, ``dtype``,
    ``refit_transport``).

    Colocated engines (``shared_bundles``: the placement group the policy also uses, one
    bundle of 1 GPU per policy rank) take :data:`COLOCATED_SHARE` of a bundle each, one engine
    per bundle; that needs ``tensor_parallel_size == 1`` and ``num_engines`` ≤ the bundles.
    Engines on their own GPUs get one bundle of ``tensor_parallel_size`` GPUs each: the engine
    actor holds them all and starts its tensor-parallel workers itself, as processes on that
    node (the plugin picks an executor that does so, e.g. vLLM's ``mp``).

    ``in_flight``: the engines take refits while they generate (see
    :class:`GenerationEngines`); their actors then run :data:`IN_FLIGHT_CONCURRENCY` calls at
    once. Refused (``ConfigError``) for colocated engines.

    ``env_vars``: the engine actors' extra environment (on a CPU-only cluster their
    ``OMP_NUM_THREADS``: :func:`nrl_core.algorithms.session.components.engine_thread_env`).
    """
    import attrs

    from nrl_core.interfaces import ComponentContext
    from nrl_core.weight_sync.adapters import ADAPTERS, lora_refit_mode, policy_lora_rank

    generation = config.generation
    options = generation.options_for()
    tp = getattr(options, "tensor_parallel_size", 1)
    engines = options.num_engines
    colocated = engines_colocated(generation, on_gpu=on_gpu)
    if in_flight and engines_sleep(generation, on_gpu=on_gpu):
        raise ConfigError(
            f"in-flight refits need separate engines; set generation.{generation.backend}."
            "colocated=false or grpo.async.in_flight_weight_updates=false"
        )
    placement = None
    gpus, cpus = (float(tp), 1.0) if on_gpu else (0.0, ENGINE_CPUS_ON_CPU)
    if colocated:
        if tp != 1:
            raise ConfigError(
                "colocated engines with tensor_parallel_size > 1 are not supported yet; set "
                f"generation.{generation.backend}.tensor_parallel_size=1 or colocated=false"
            )
        if shared_bundles is None or engines > shared_bundles.bundle_count:
            raise ConfigError(
                f"colocated generation needs generation.{generation.backend}.num_engines "
                f"({engines}) ≤ policy.num_workers (one engine per policy GPU)"
            )
        placement = shared_bundles
        gpus, cpus = COLOCATED_SHARE, COLOCATED_SHARE
    # Before any engine starts: a transport the layout cannot use is a config error.
    transport = resolve_transport(
        getattr(options, "refit_transport", "auto"),
        colocated=colocated,
        on_gpu=on_gpu,
        section=f"generation.{generation.backend}",
    )
    lora_refit = lora_refit_mode(config)
    context = context or ComponentContext(config=config, seed=config.seed)
    if lora_refit == ADAPTERS:
        # The engines' copy of the config lacks the policy's options: hand them the rank.
        context = attrs.evolve(context, lora_adapter_rank=policy_lora_rank(config))
    group = WorkerGroup.start(
        spec.target,
        engines,
        args=(options, context),
        name=f"generation-{generation.backend}",
        python=python,
        env_vars=env_vars or None,
        num_cpus_per_worker=cpus,
        num_gpus_per_worker=gpus,
        placement_group=placement,
        timeout_s=timeout_s,
        **({"max_concurrency": IN_FLIGHT_CONCURRENCY} if in_flight else {}),
    )
    engines_obj = GenerationEngines(
        group,
        transport=transport,
        bucket_bytes=int(options.refit_bucket_mb) << 20,
        dtype=getattr(options, "dtype", None) if on_gpu else None,
        colocated=engines_sleep(generation, on_gpu=on_gpu),
        nccl_per_tensor=generation.backend == "sglang",
        layout=getattr(options, "weight_layout", CHECKPOINT),
        lora_refit=lora_refit,
        in_flight=in_flight,
    )
    engines_obj.tp_size = tp
    return engines_obj
