"""The distributed runtime: Ray clusters, worker groups of actors, per-plugin actor venvs.

Importing this package is cheap; Ray is imported by the submodules that need it
(:mod:`~nrl_core.distributed.cluster`, :mod:`~nrl_core.distributed.worker_group`).
"""
