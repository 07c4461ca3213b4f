"""Checkpoints of the megatron policy worker: one file per rank, the distributed optimizer's
parameter-state files on GPU, and loading a CPU-path checkpoint of another layout (resharding).
A mixin of :class:`nrl_megatron.worker.MegatronPolicyWorker`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from nrl_megatron.convert import shard_for_tp, tp_split_dim, unshard_from_tp
from nrl_megatron.errors import MegatronSetupError


@contextlib.contextmanager
def _adam_step_set_aside(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Hide torch Adam's per-parameter ``step`` while Megatron-Core loads the distributed
    optimizer's parameter state, and put it back after.

    Without Apex or Transformer Engine, Megatron-Core 0.16.1 runs torch's Adam:
    ``load_state_dict`` sets ``state[p]["step"]`` (distrib_optimizer.py:817), but the parameter
    state file holds only ``param``, ``exp_avg`` and ``exp_avg_sq`` ("step" is handled separately
    when saving, :1819), and ``_set_main_param_and_optimizer_states`` copies every key the live
    state has (:939), so the load fails with ``KeyError: 'step'`` (seen on an H100,
    2026-11-26). The step count itself comes from the optimizer state dict loaded before, but
    as ONE tensor shared by every parameter (:825); torch's Adam increments each parameter's
    ``step`` in place, so a shared one would count every parameter's update and skew the bias
    correction after a resume. Each parameter gets its own copy back."""
    states = [optimizer.state for optimizer in optimizers]
    aside = [{p: s.pop("step") for p, s in state.items() if "step" in s} for state in states]
    try:
        yield
    finally:
        for state, steps in zip(states, aside, strict=True):
            for param, step in steps.items():
                state[param]["step"] = step.detach().clone()


class CheckpointMixin:
    """``save_checkpoint``/``load_checkpoint`` and the optimizer-state helpers they use, for
    :class:`~nrl_megatron.worker.MegatronPolicyWorker`."""

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.on_gpu:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        if self.lora_dropout is not None:
            # LoRA's dropout masks have their own generator (nrl_megatron.lora.LoraDropout).
            state["lora_dropout"] = self.lora_dropout.generator.get_state()
        return state

    def _parameter_state_file(self, path: str) -> str:
        """The distributed optimizer's parameter-state file this rank writes and reads.

        Megatron writes it on data-parallel rank 0 of each chained optimizer's group
        (``ChainedOptimizer.save_parameter_state``): dense DP rank 0 of every (stage, TP rank),
        and, for the experts' optimizer, expert-DP rank 0 of every (stage, TP rank, EP rank),
        each with its own shard's state. Named by all three, so no two writers share a file
        (with PP > 1 or EP > 1 a name by TP rank alone was written by several ranks and read
        back by the wrong ones); a rank that does not write reads its writer's file, which has
        the same key."""
        return str(Path(path) / f"distopt_pp{self.pp_rank}_tp{self.tp_rank}_ep{self.ep_rank}.pt")

    def _legacy_parameter_state_file(self, path: str) -> str:
        # Checkpoints written before the per-stage, per-expert-rank names: one file per TP rank,
        # which only a layout with one stage and no expert parallelism wrote unambiguously.
        return str(Path(path) / f"distopt_tp{self.tp_rank}.pt")

    def save_checkpoint(self, path: str) -> None:
        """Save this rank's model shard, optimizer, step and RNG states under ``path``.

        One file per rank (``rank{N}.pt``). On the CPU path the files also name the optimizer's
        parameters, so that :meth:`load_checkpoint` can reshard them to another layout (not
        Megatron's ``dist_checkpointing``: its loader unpickles metadata, and nrl loads nothing
        that can run code). With the GPU's distributed optimizer the layout must stay the same.

        GPU (Megatron's distributed optimizer): its ``state_dict()`` holds only the parameter
        groups and the grad scaler; Adam's ``exp_avg``/``exp_avg_sq`` and the float32 main
        weights are its *parameter state* (megatron-core 0.16.1
        ``optimizer/distrib_optimizer.py:628-634``), which ``save_parameter_state`` gathers over
        the data-parallel group and writes on its rank 0 (``distrib_optimizer.py:1126``,
        through ``ChainedOptimizer.save_parameter_state``, ``optimizer/optimizer.py:1340``) into
        ``distopt_pp{P}_tp{T}_ep{E}.pt`` (:meth:`_parameter_state_file`). Without it a resume
        would silently restart Adam from zero.

        Before the first optimizer step (a checkpoint at step 0) the optimizer has no state to
        save, and Megatron's ``state_dict()`` asserts on exactly that (its step count comes
        from Adam's per-parameter state, ``distrib_optimizer.py:638-640``; the parameter state
        has no ``exp_avg`` yet): the checkpoint then records ``"optimizer": None``, and loading
        it gives the optimizer the fresh state it had.
        """
        Path(path).mkdir(parents=True, exist_ok=True)
        stepped = self._optimizer_has_state()
        torch.save(
            {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if stepped else None,
                "step": self.step,
                "rng": self._rng_state(),
                "layout": self._layout(),
                # The CPU optimizer's parameters in its order (its state is keyed by position):
                # what lets another layout find each moment's parameter (_load_resharded).
                "param_names": (
                    self._optimizer_param_names() if self.megatron_optimizer is None else None
                ),
            },
            Path(path) / f"rank{self.rank}.pt",
        )
        if self.megatron_optimizer is not None and stepped:
            # A collective over the data-parallel group (gloo gather); all ranks call it.
            self.megatron_optimizer.save_parameter_state(self._parameter_state_file(path))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote. The CPU path (``torch.optim``) also
        loads a checkpoint of another tensor, pipeline or data-parallel layout
        (:meth:`_load_resharded`); Megatron's distributed optimizer (GPU) needs the same
        layout."""
        from nrl_core.safe_pickle import torch_load_data

        # weights_only (torch_load_data): a checkpoint is data; unpickling arbitrary objects
        # could run code. A refused file is one line naming it.
        own_file = Path(path) / f"rank{self.rank}.pt"
        # A rank the saving layout did not have reads rank 0's file (for its RNG state only).
        state = torch_load_data(
            own_file if own_file.is_file() else Path(path) / "rank0.pt", map_location="cpu"
        )
        layout = self._layout()
        saved = {"pp": 1, **state["layout"]}
        if saved != layout and self._can_reshard(state, layout):
            self._load_resharded(path, saved)
            self.step = state["step"]
            self._set_rng_state(state["rng"])
            dist.barrier()
            return
        if saved != layout:
            raise MegatronSetupError(
                f"checkpoint {path} was written with {state['layout']}, this run has {layout}; "
                "resume with the same policy.num_workers, tensor_model_parallel_size, "
                "pipeline_model_parallel_size and expert_model_parallel_size"
            )
        self._check_optimizer_path(path, state["optimizer"])
        self.module.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self._reset_optimizer_state()  # saved before the first step: a fresh optimizer
        else:
            self._load_optimizer_state(path, state["optimizer"])
        self.step = state["step"]
        self._set_rng_state(state["rng"])
        dist.barrier()

    def _check_optimizer_path(self, path: str, saved: dict | list | None) -> None:
        """Refuse, in one line and before anything is loaded, optimizer state written by the
        other optimizer path: the CPU path saves ``torch.optim``'s state dict (``state`` and
        ``param_groups``), the GPU path Megatron's distributed optimizer's (``optimizer`` and
        its parameter-state files; a list when chained), and neither loads the other's."""
        if saved is None:
            return  # saved before the first step: either path starts a fresh optimizer
        torch_state = isinstance(saved, dict) and {"state", "param_groups"} <= saved.keys()
        convert = "or convert it there to a Hugging Face folder (nrl convert) and start from that"
        if self.megatron_optimizer is not None and torch_state:
            raise MegatronSetupError(
                f"checkpoint {path} was written by the megatron policy's CPU path (torch.optim "
                "state), which Megatron's distributed optimizer on GPU cannot load; resume it "
                f"on CPU, {convert}"
            )
        if self.megatron_optimizer is None and not torch_state:
            raise MegatronSetupError(
                f"checkpoint {path} was written by the megatron policy's GPU path (Megatron's "
                "distributed optimizer), which the CPU path's torch.optim cannot load; resume "
                f"it on a GPU, {convert}"
            )

    def _set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and self.on_gpu:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        if "lora_dropout" in rng and self.lora_dropout is not None:
            self.lora_dropout.generator.set_state(rng["lora_dropout"])

    def _optimizer_param_names(self) -> list[str]:
        """The local names of the optimizer's parameters, in its order (CPU path)."""
        names = {id(param): name for name, param in self.module.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def _can_reshard(self, saved: dict, layout: dict[str, int]) -> bool:
        """Whether a checkpoint of another layout can be loaded here: both sides use the CPU
        path's ``torch.optim`` optimizer (Megatron's distributed optimizer keeps its own
        parameter-state files), the files name the optimizer's parameters, and neither side
        splits experts (resharding expert-parallel files is not written)."""
        return (
            self.megatron_optimizer is None
            and saved.get("param_names") is not None
            and "ep" not in saved["layout"]
            and "ep" not in layout
        )

    def _load_resharded(self, path: str, saved: dict) -> None:
        """Load a checkpoint written with another tensor/pipeline/data-parallel layout
        (``saved``): the files of data-parallel rank 0 of every (stage, tensor rank) together
        hold the whole model and its optimizer moments; they are put together under
        whole-model names, unsharded over the saving tensor parallelism, and this rank takes
        its stage's layers and its tensor-parallel slice (the same functions that cut the Hugging
        Face checkpoint at start-up)."""
        from nrl_core.distributed.worker_group import ParallelLayout
        from nrl_core.safe_pickle import torch_load_data
        from nrl_megatron.pipeline import global_name, layers_per_stage, local_state

        old = ParallelLayout(tp=saved["tp"], pp=saved["pp"])
        world = saved["world_size"]
        per = layers_per_stage(self.shape.num_layers, old.pp)
        shards: dict[str, dict[int, torch.Tensor]] = {}  # name -> {tp rank: tensor}
        moments: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # key -> name -> ...
        steps: dict[str, torch.Tensor] = {}
        for rank in range(world):
            if old.dp_rank(rank, world) != 0:
                continue
            state = torch_load_data(Path(path) / f"rank{rank}.pt", map_location="cpu")
            offset, tp_rank = old.pp_rank(rank, world) * per, old.tp_rank(rank)
            for name, tensor in state["model"].items():
                if not name.endswith("_extra_state") and tensor is not None:
                    shards.setdefault(global_name(name, offset), {})[tp_rank] = tensor
            if state["optimizer"] is None:
                continue
            names = state["param_names"]
            for index, param_state in state["optimizer"]["state"].items():
                name = global_name(names[index], offset)
                for key, value in param_state.items():
                    if key == "step":
                        steps[name] = value
                    elif isinstance(value, torch.Tensor):
                        moments.setdefault(key, {}).setdefault(name, {})[tp_rank] = value

        def whole(parts: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
            out = {}
            for name, by_rank in parts.items():
                ordered = [by_rank[t] for t in sorted(by_rank)]
                split = old.tp > 1 and tp_split_dim(name) is not None
                out[name] = unshard_from_tp(name, ordered) if split else ordered[0]
            return out

        def mine(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            local = local_state(full, self.pp_rank, self.shape.num_layers, self.pp_size)
            return {n: shard_for_tp(n, t, self.tp_rank, self.tp_size) for n, t in local.items()}

        model_state = mine(whole(shards))
        missing, unexpected = self.module.load_state_dict(model_state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise MegatronSetupError(
                f"checkpoint {path} ({saved}) does not fit this model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        self._reset_optimizer_state()
        if not steps:
            return  # saved before the first step: a fresh optimizer
        local_moments = {key: mine(whole(parts)) for key, parts in moments.items()}
        per_here = layers_per_stage(self.shape.num_layers, self.pp_size)
        params = dict(self.module.named_parameters())
        for name in self._optimizer_param_names():
            whole_name = global_name(name, self.pp_rank * per_here)
            state = {key: values[name].to(self.device) for key, values in local_moments.items()}
            self.optimizer.state[params[name]] = {"step": steps[whole_name].clone(), **state}

    def _layout(self) -> dict[str, int]:
        """The parallel layout a checkpoint's per-rank files belong to; ``ep`` only when experts
        are split (files of dense or EP=1 runs keep the layout they always had)."""
        layout = {"tp": self.tp_size, "pp": self.pp_size, "world_size": self.world_size}
        if self.ep_size > 1:
            layout["ep"] = self.ep_size
        return layout

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The ``torch.optim`` optimizers that hold the per-parameter state: the CPU path's own,
        or the one each of Megatron's (chained) distributed optimizers wraps (``.optimizer``)."""
        if self.megatron_optimizer is None:
            return [self.optimizer]
        chained = getattr(self.megatron_optimizer, "chained_optimizers", None)
        return [o.optimizer for o in (chained or [self.megatron_optimizer])]

    def _optimizer_has_state(self) -> bool:
        """Whether an optimizer step has created per-parameter state (Adam's moments). The same
        on every rank: all ranks step together."""
        return any(len(optimizer.state) > 0 for optimizer in self._torch_optimizers())

    def _reset_optimizer_state(self) -> None:
        """The optimizer as it was before its first step, for the weights just loaded."""
        for optimizer in self._torch_optimizers():
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group.pop("step", None)  # Transformer Engine's FusedAdam counts steps here
        if self.megatron_optimizer is not None:
            # Its float32 main weights are copies of the model's: take the loaded ones.
            self.megatron_optimizer.reload_model_params()

    def _load_optimizer_state(self, path: str, state: dict) -> None:
        # Checked before anything is loaded: a refused checkpoint leaves the optimizer as it was.
        distributed = self.megatron_optimizer is not None
        state_file = self._parameter_state_to_load(path) if distributed else None
        self.optimizer.load_state_dict(state)
        if distributed:
            # load_state_dict() above allocated placeholder moments (distrib_optimizer.py:690);
            # the parameter state file fills them and the main weights, scattered from
            # data-parallel rank 0 (distrib_optimizer.py:2253, 1965).
            with _adam_step_set_aside(self._torch_optimizers()):
                self.megatron_optimizer.load_parameter_state(state_file)

    def _parameter_state_to_load(self, path: str) -> str:
        """The parameter-state file of checkpoint ``path`` for this rank, or a one-line
        :class:`MegatronSetupError` when it has none this rank can trust."""
        state_file = self._parameter_state_file(path)
        legacy = self._legacy_parameter_state_file(path)
        if not Path(state_file).is_file() and Path(legacy).is_file():
            if self.pp_size > 1 or self.ep_size > 1:
                raise MegatronSetupError(
                    f"checkpoint {path} names its optimizer state by tensor-parallel rank only "
                    f"({Path(legacy).name}), which the pipeline stages and expert-parallel "
                    "ranks overwrote in each other; resume from a checkpoint written since"
                )
            state_file = legacy  # one stage, no expert parallelism: one writer per TP rank
        if not Path(state_file).is_file():
            raise MegatronSetupError(
                f"checkpoint {path} has no {Path(state_file).name} (the distributed "
                "optimizer's moments and main weights); resume from a checkpoint written "
                "by a GPU run of the megatron policy"
            )
        return state_file
