"""Does Megatron-Core's pipeline schedule run on CPU over gloo? (issue 37, groundwork)

Runs the tiny Llama (``nrl_core.testing.tiny``) as a ``GPTModel`` (nrl-megatron's local spec)
once whole (PP=1, one process) and once split over 2 pipeline stages (2 processes, gloo) through
``megatron.core.pipeline_parallel.get_forward_backward_func()``, with the same weights and
batch, and prints each run's loss and squared gradient norm (summed over its parameters).

``--cpu-devices``: diagnostic only, NOT a fix: replaces the schedule's hard-coded CUDA devices
(``torch.zeros(..., device="cuda")``, ``torch.cuda.current_device()``) with the CPU inside the
probe's processes, to see what fails after them.

Needs megatron-core (the `plugin-megatron` venv, or docs/megatron.md's ``.venv-megatron``)::

    PYTHONPATH=plugins/nrl-megatron/src .venv-megatron/bin/python \
        benchmarks/megatron_pp_probe.py [--cpu-devices]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, BATCH = 16, 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=generator)
    return ids, torch.arange(SEQ)[None].expand(BATCH, -1)


def _model(path: str, pp: int, pre: bool = True, post: bool = True):
    from nrl_megatron.model import build_gpt_model, transformer_config
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    return hf, build_gpt_model(
        hf, transformer_config(hf, pp=pp), pre_process=pre, post_process=post
    )


def _init(rank: int, world: int, port: int, pp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)


def _grad_sq(model) -> float:
    return sum(float(p.grad.double().norm() ** 2) for p in model.parameters() if p.grad is not None)


def reference(rank: int, path: str, weights: str, out: str) -> None:
    """PP=1: random weights (saved for the stages), one forward and backward."""
    _init(rank, 1, 29611, 1)
    _, model = _model(path, 1)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(state, weights)
    loss = model(*_batch(), None).float().mean()
    loss.backward()
    Path(out).write_text(f"PP=1: loss {float(loss)!r} grad_sq {_grad_sq(model)!r}")


def stage(rank: int, path: str, weights: str, out: str, cpu_devices: bool) -> None:
    """PP=2: this stage's layers of the reference weights, through Megatron's schedule."""
    _init(rank, 2, 29612, 2)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    hf, model = _model(path, 2, pre=first, post=last)
    offset = ps.get_pipeline_model_parallel_rank() * hf.num_hidden_layers // 2
    full = torch.load(weights, weights_only=True)

    def global_name(name: str) -> str:
        return re.sub(
            r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name
        )

    own = {n: full[global_name(n)] for n in model.state_dict() if not n.endswith("_extra_state")}
    model.load_state_dict(own, strict=False)
    if cpu_devices:
        _cpu_devices()
    ids, positions = _batch()

    def forward_step(_, module):
        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return module(ids, positions, None), loss_func

    schedule = get_forward_backward_func()
    line = f"PP=2 stage {rank} ({schedule.__name__}): "
    try:
        result = schedule(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        losses = [float(r["loss"]) for r in result]
        line += f"loss {losses!r} grad_sq {_grad_sq(model)!r}"
    except Exception as exc:  # the finding is the failure itself
        frames = [
            f for f in traceback.extract_tb(exc.__traceback__) if "megatron/core" in f.filename
        ]
        where = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        short = where.filename.split("site-packages/")[-1]
        line += f"FAILED {type(exc).__name__}: {str(exc)[:80]} at {short}:{where.lineno}"
    Path(f"{out}.{rank}").write_text(line)


def _cpu_devices() -> None:
    import megatron.core.pipeline_parallel.schedules as schedules

    zeros = torch.zeros

    class _Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return zeros(*args, **kwargs)

    schedules.torch = _Torch()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-devices", action="store_true")
    args = parser.parse_args()
    from nrl_core.testing.tiny import tiny_model_path

    path = str(tiny_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        weights, out = f"{tmp}/weights.pt", f"{tmp}/out"
        mp.spawn(reference, args=(path, weights, f"{out}.ref"), nprocs=1)
        print(Path(f"{out}.ref").read_text())
        mp.spawn(stage, args=(path, weights, out, args.cpu_devices), nprocs=2)
        for rank in range(2):
            print(Path(f"{out}.{rank}").read_text())


if __name__ == "__main__":
    main()
