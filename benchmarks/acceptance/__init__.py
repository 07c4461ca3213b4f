"""GPU acceptance: run on one GPU what of nrl's GPU path can run without vLLM or SGLang.

    python benchmarks/gpu_acceptance.py [--device auto|cuda|cpu] [--only STAGE,...]
                                        [--out REPORT.json] [--workdir DIR] [--budget-s S]
                                        [--profile quick|qwen2-0.5b|tiny] [--jobs N]

Stages, in order, each in a subprocess of its own with a time limit:

- ``model``: build a Qwen2-shaped causal LM with random weights and nrl's character-level
  tokenizer (:func:`nrl_core.testing.tiny.build_tokenizer`) into the work folder with
  ``save_pretrained`` (on ``cuda``: the Qwen2.5-0.5B shape, ~0.49B parameters, bf16; on ``cpu``
  a tiny one). Every later stage loads it through ``from_pretrained``.
- ``dtensor``: the nrl-dtensor policy worker as one rank of a real ``torch.distributed`` world
  (NCCL and bf16 on ``cuda``, gloo and float32 on ``cpu``; FSDP2 applied), driven by the core's
  :class:`~nrl_core.policy.Policy` facade: training steps (forward_backward + optimizer_step)
  and logprobs; tokens/s and peak memory. Then the hand-over to colocated engines,
  ``offload(["optimizer"])``, ``offload(["weights"])``, ``onload()`` (on a GPU the memory must
  go down; the step after must still train).
- ``generation``: nrl-dtensor's :class:`~nrl_dtensor.generation.TorchGenerator` on the device;
  generated tokens/s.
- ``cuda_ipc_refit``: the model's weights pushed by :class:`nrl_core.weight_sync.WeightSender`
  from one Ray actor to another (two processes; on ``cuda`` both on the same GPU, transport
  ``cuda_ipc``; on ``cpu`` transport ``shm``); the receiver checks every tensor bit-exact; GB/s.
  A last refit crosses msgpack in nrl's wire form first (as into vLLM's engine core). The
  memory of both processes must not grow from the first refit to the last.
- ``megatron``: the nrl-megatron policy worker (Megatron-Core ``GPTModel``; on ``cuda`` bf16 and
  Megatron's distributed optimizer): first the refit's Hugging Face-named buckets, bit-exact
  against the checkpoint; then training steps, logprobs and the same hand-over. SKIP when
  megatron-core is not importable (the dev venv; the GPU bundle brings its wheel).
- ``megatron_moe``: the same worker on a tiny Qwen3-MoE (4 experts, top-2) built in the work
  folder: on ``cuda`` Megatron-Core's ``alltoall`` dispatcher, Megatron DDP with the experts and
  the distributed optimizer (what CPU cannot build); the refit and ``export_hf`` bit-exact, each
  expert once; logprobs against transformers' forward; training steps and ``train/moe/*``; on
  ``cuda`` the experts must run as a grouped GEMM (their class, e.g. not ``SequentialMLP``:
  ``megatron_moe._experts_are_grouped``). Not in ``quick`` (SKIP there, with how to run it);
  same SKIP as ``megatron`` without megatron-core.
- ``memory_plan``: the memory preflight's static estimate of one policy GPU
  (``nrl_core.memory_plan``) against ``torch.cuda.max_memory_allocated()`` after one training
  step on a tiny batch, for the ``dtensor`` and ``megatron`` layouts, each in a process of its
  own; PASS when estimate / measured is within 0.8-1.5 (the module says why). SKIP on ``cpu``
  (with the estimates), where ``nrl_core.memory_plan`` is absent, and in ``quick``.
- ``grpo_step``: ``nrl run grpo`` through the real CLI on the built model (policy ``dtensor``,
  colocated ``torch`` generation, the ``arithmetic`` environment, the trainer recomputing the
  rollouts' logprobs); tokens/s and ``train/gen_logprob_error`` from its ``metrics.jsonl``.

Profiles: ``quick`` (the default on ``cuda``; sized so that the bundle's install and every stage
fit one 8-minute device command, :func:`plan_seconds`), ``qwen2-0.5b`` (larger workloads) and
``tiny`` (``cpu``).

Each stage prints one line ``PASS|FAIL|SKIP <stage> <seconds>s <figures or reason>``; the JSON
report (``--out``, rewritten after every stage) holds the figures, the versions and each stage's
log file. The exit status is 1 when a stage failed, 2 on a bad argument, else 0.

``--device cpu`` (what CI runs, tests/benchmarks/test_gpu_acceptance.py) runs the same stage
functions on the tiny model: the device is the only difference (children then see no CUDA
device, ``CUDA_VISIBLE_DEVICES=""``). How to run it on a lent GPU machine, with the wheels the
machine lacks (``benchmarks/gpu_bundle.py``): benchmarks/README.md.

The package, one module per concern: :mod:`.runner` (the command line, the stages' child
processes, the report), :mod:`.profiles` (stages, profiles, the device plan), :mod:`.common`
(what a stage receives, its outcomes, device plumbing), :mod:`.policy` (what the policy stages
share) and one module per stage (:mod:`.model`, :mod:`.dtensor`, :mod:`.generation`,
:mod:`.refit`, :mod:`.megatron`, :mod:`.megatron_moe`, :mod:`.memory_plan`,
:mod:`.grpo`). ``benchmarks/`` is not an installed package: ``benchmarks/gpu_acceptance.py``
puts its folder on ``sys.path`` and calls :func:`.runner.main` (``python -m acceptance`` from ``benchmarks/`` does the same).
"""
