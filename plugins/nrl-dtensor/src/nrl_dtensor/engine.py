"""A torch generation engine on its own Ray worker (``generation.torch.colocated=false``).

The separate-engine path that vLLM and SGLang take, with the :class:`TorchGenerator` sampler:
each engine loads ``policy.model_name`` itself, holds its own copy of the weights, and receives
the policy's weights through :class:`nrl_core.interfaces.WeightSync` (buckets over shared
memory, as :class:`nrl_core.generation.GenerationEngines` sends them). The core places the
engines, shards the prompts across them and refits them; this class only generates and loads
buckets. On CPU it makes that whole path run for real.

Engine ``e`` samples with seed stream ``e`` (the stream colocated rank ``e`` uses), so
``num_engines`` engines given the weights of a policy with as many ranks sample exactly what
colocated generation samples.

In-flight refits (issue 51 item 2): a refit that arrives while a call generates (an actor
that takes calls concurrently) is staged and swapped in between two decode steps; once the
engine knows its weights' version (:meth:`TorchEngine.set_weight_version`), every generated
token records the version that produced it (``GenerationOutput.weight_versions``). The KV
cache of the tokens before the swap keeps the old weights' keys and values, as in vLLM's
in-flight updates.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import torch

from nrl_core import memory_contract
from nrl_core.interfaces import ComponentContext, GenerationOutput, SamplingParams
from nrl_core.weight_sync import BucketHandle, BucketMeta, WeightSyncError, receive_into
from nrl_dtensor.config import TorchGenerationConfig
from nrl_dtensor.generation import TorchGenerator


class TorchEngine:
    """One torch generation engine: :class:`TorchGenerator` over a model of its own, plus
    :class:`~nrl_core.interfaces.WeightSync`."""

    def __init__(self, options: TorchGenerationConfig | None, context: ComponentContext) -> None:
        options = options or TorchGenerationConfig()
        model, tokenizer = TorchGenerator._load(context)
        self.generator = TorchGenerator(
            options,
            context,
            model=model,
            tokenizer=tokenizer,
            synchronize=False,
            seed_offset=context.rank,
        )
        self.model = model
        self.tokenizer = tokenizer
        # Tied weights (embeddings and LM head) arrive under both names: keep both.
        self._parameters = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers())
        self._loaded: set[str] = set()
        self._lora_settings: tuple | None = None
        self._lora_tensors: dict[str, torch.Tensor] = {}
        self.adapter_version = 0
        """The version of the last LoRA adapter applied (0: none)."""
        self.memory = memory_contract.EngineMemory(f"torch engine {context.rank}")
        """Sleep state under the memory contract (see :meth:`sleep`)."""
        self.weight_version: int | None = None
        """The version (optimizer steps, >= 0) of the weights the model holds; None: unknown
        (then generate leaves ``weight_versions`` to the driver's gate)."""
        self._swap = threading.Lock()  # guards the staged refit and the generating count
        # A threaded actor (in-flight refits) may get several generate calls at once: the
        # generator and the per-call version records serve one at a time.
        self._calls = threading.Lock()
        self._next_version: int | None = None  # announced for the next refit
        self._generating = 0
        self._staged: dict[str, torch.Tensor] | None = None  # a refit arriving mid-call
        self._pending: tuple[dict[str, torch.Tensor], int | None] | None = None
        self._forward_versions: list[int | None] = []
        self._call_versions: list[list[int]] = []
        model.register_forward_pre_hook(self._between_steps)
        # The generator's chunk loop, wrapped here (not in generation.py) to map each
        # chunk's forwards to its tokens.
        self._generate_chunk = self.generator._generate_chunk
        self.generator._generate_chunk = self._versioned_chunk

    def set_weight_version(self, version: int) -> None:
        """Record that the weights now held are ``version`` (>= 0; the driver calls it after
        a refit); later refits without a version count on from it."""
        with self._swap:
            self.weight_version = int(version)

    def expect_weight_version(self, version: int) -> None:
        """Announce that the next refit's weights are ``version`` (>= 0): the driver calls it
        before a refit that may land mid-call (``GenerationEngines`` with ``in_flight``), so
        the tokens after the swap record it, whenever the swap happens."""
        with self._swap:
            self._next_version = int(version)

    def _between_steps(self, module, args) -> None:
        """Before every forward (prefill or decode step): swap in a staged refit, then note
        the version this forward runs on."""
        with self._swap:
            if self._pending is not None:
                self._apply(*self._pending)
                self._pending = None
            self._forward_versions.append(self.weight_version)

    def _apply(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._parameters.get(name, self._buffers.get(name)).copy_(tensor)
        self.weight_version = version

    def _versioned_chunk(self, forward, prompts, *args):
        """One chunk of :meth:`TorchGenerator.generate`, recording each token's version: the
        chunk's last ``S`` forwards produced its ``S`` decode steps (token ``i`` of every row
        came from forward ``F - S + i``; the forwards before are the prefill)."""
        self._forward_versions = []
        ids, lps, why = self._generate_chunk(forward, prompts, *args)
        steps, forwards = max((len(row) for row in ids), default=0), self._forward_versions
        first = len(forwards) - steps
        for row in ids:
            versions = forwards[first : first + len(row)] if first >= 0 else []
            known = len(versions) == len(row) and all(v is not None for v in versions)
            self._call_versions.append(list(versions) if known else None)
        return ids, lps, why

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
    ) -> GenerationOutput:
        """Continue each prompt with this engine's current weights (none: an empty output).
        Wakes what still sleeps (after a refit: the KV cache), and refuses weights that a sleep
        dropped (memory contract)."""
        self.memory.wake_up(sorted(self.memory.sleeping))
        self.memory.check_generate()
        with self._calls:
            with self._swap:
                self._generating += 1
            self._call_versions = []
            try:
                output = self.generator.generate(prompts, params, stop_strings)
            finally:
                with self._swap:
                    self._generating -= 1
                    if self._pending is not None and not self._generating:
                        self._apply(*self._pending)  # arrived after the last decode step
                        self._pending = None
            versions = self._call_versions
        if len(versions) == len(output.token_ids) and all(v is not None for v in versions):
            return attrs.evolve(output, weight_versions=versions)
        return output

    def sleep(self) -> bool:
        """Torch engines share no GPU with the policy (``colocated=false`` is what makes them),
        so the core does not put them to sleep and nothing is released. Under the memory
        contract (``NRL_MEMORY_CONTRACT=1``: tests) this is a GPU engine's deep sleep (vLLM
        level 2): the weights become NaN and generate refuses until a refit. Returns whether
        the weights survive."""
        if not memory_contract.enabled():
            return True
        if "weights" not in self.memory.sleeping:
            memory_contract.drop(self._parameters.values())
        self.memory.sleep(keeps_weights=False)
        return False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``; None: both); waking an awake one is an
        error, as on a GPU engine (memory contract)."""
        self.memory.wake_up(tags)

    # -- weight sync (nrl_core.interfaces.WeightSync) --------------------------------------

    def begin_weight_update(self) -> None:
        """Start a refit: the weights wake (the KV cache keeps sleeping until generate)."""
        if "weights" in self.memory.sleeping:
            self.memory.wake_up(["weights"])
        self.memory.begin_refit()
        self._loaded = set()
        with self._swap:
            # A call generates, or may start before the refit ends (the driver announced the
            # version: in-flight refits, whose gate lets calls in flight go on): stage the
            # weights and swap them in between two decode steps.
            mid_call = self._generating or self._next_version is not None
            self._staged = {} if mid_call else None

    def receive_bucket(self, meta: BucketMeta, handle: BucketHandle) -> int:
        """Copy one bucket into the model's tensors of the same names (bit-exact: the copy
        casts only when the engine keeps another dtype)."""

        def load(named: list) -> None:
            with torch.no_grad():
                for name, tensor in named:
                    target = self._parameters.get(name, self._buffers.get(name))
                    if target is None:
                        raise WeightSyncError(
                            f"the policy sent {name!r}, which this engine's model does not have; "
                            "policy and generation must load the same architecture"
                        )
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise WeightSyncError(
                            f"the policy sent {name!r} with shape {tuple(tensor.shape)}; this "
                            f"engine's model has {tuple(target.shape)}"
                        )
                    if self._staged is not None:
                        self._staged[name] = tensor.clone()
                    else:
                        target.copy_(tensor)
                    self._loaded.add(name)

        return receive_into(meta, handle, load)

    def finish_weight_update(self, version: int | None = None) -> None:
        """Refuse a refit that left parameters untouched: the engine would generate from a mix
        of old and new weights. ``version`` (>= 0): the new weights' version (default: one
        more than the last known, unknown if none is); a refit staged during a call takes
        effect at its next decode step."""
        missing = sorted(set(self._parameters) - self._loaded)
        if missing:
            raise WeightSyncError(
                f"a refit sent no value for {len(missing)} of this engine's parameters "
                f"(first: {missing[0]}); the policy must send its full state dict"
            )
        with self._swap:
            if version is None:
                version = self._next_version
            if version is None and self.weight_version is not None:
                version = self.weight_version + 1
            self._next_version = None
            staged, self._staged = self._staged, None
            if staged is None:
                self.weight_version = version
            elif self._generating:
                self._pending = (staged, version)
            else:  # the call ended meanwhile
                self._apply(staged, version)
        self.memory.finish_refit()

    # -- adapter-only LoRA refits (nrl_core.weight_sync.adapters) ---------------------------

    def load_lora_adapter(self, adapter, meta: BucketMeta, handle: BucketHandle) -> int:
        """Apply a LoRA adapter (PEFT-named tensors in one bucket, ``adapter`` a
        :class:`~nrl_core.weight_sync.adapters.LoraAdapter`) onto the base weights this engine
        holds, through peft: the first one injects peft's LoRA layers into the model (in
        place, so the generator's model runs them), later ones overwrite their tensors."""
        self._inject_lora(adapter)
        loaded: set[str] = set()

        def load(named: list) -> None:
            with torch.no_grad():
                for name, tensor in named:
                    # PEFT's saved name -> the injected layer's tensor of adapter "default".
                    module, _, leaf = name.removeprefix("base_model.model.").rpartition(".lora_")
                    kind, _, rest = leaf.partition(".")
                    target = self._lora_tensors.get(f"{module}.lora_{kind}.default.{rest}")
                    if target is None or tuple(target.shape) != tuple(tensor.shape):
                        raise WeightSyncError(
                            f"the policy sent adapter tensor {name!r} "
                            f"{tuple(tensor.shape)}, which this engine's LoRA layers (rank "
                            f"{adapter.rank}, targets {list(adapter.target_modules)}) lack"
                        )
                    target.copy_(tensor)
                    loaded.add(name)

        nbytes = receive_into(meta, handle, load)
        if len(loaded) != len(self._lora_tensors):
            raise WeightSyncError(
                f"adapter {adapter.name} sent {len(loaded)} of this engine's "
                f"{len(self._lora_tensors)} LoRA tensors; the policy must send all of them"
            )
        self.adapter_version = adapter.version
        return nbytes

    def _inject_lora(self, adapter) -> None:
        """Inject peft's LoRA layers into this engine's model at the first adapter (in place:
        the generator's model runs them); every later adapter must share its settings (the
        layers' shapes follow from them)."""
        settings = (adapter.rank, adapter.alpha, tuple(adapter.target_modules))
        if self._lora_settings is not None:
            if self._lora_settings != settings:
                raise WeightSyncError(
                    f"adapter {adapter.name} has rank {adapter.rank}, alpha {adapter.alpha}, "
                    f"targets {list(adapter.target_modules)}; this engine's LoRA layers were "
                    f"made for (rank, alpha, targets) {self._lora_settings}"
                )
            return
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha,
            lora_dropout=0.0,
            target_modules=list(adapter.target_modules),
        )
        inject_adapter_in_model(config, self.model)
        self.model.eval()
        self._lora_settings = settings
        named = dict(self.model.named_parameters(remove_duplicate=False))
        self._lora_tensors = {n: t for n, t in named.items() if ".lora_" in n}
        # Base-weight refits (after a sleep dropped the weights) keep the plain names: map
        # them to the wrapped layers' ``base_layer`` tensors, and leave the adapter out.
        self._parameters = {
            n.replace(".base_layer.", "."): t for n, t in named.items() if ".lora_" not in n
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's weights (tests compare them with the trainer's bit for bit)."""
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}
