"""The ``ray`` cluster component: joins a running Ray cluster (``cluster.address`` or
``$RAY_ADDRESS``) and never stops it."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from nrl_core.distributed.errors import ClusterError
from nrl_core.distributed.ray_output import RayOutputToRunLog
from nrl_core.distributed.resources import ray_resources
from nrl_core.interfaces import ClusterResources


def cluster_section(context: Any) -> Any:
    """The run's ``cluster`` config section (defaults where the context has none)."""
    config = getattr(context, "config", None)
    cluster = getattr(config, "cluster", None)
    if cluster is None:
        from nrl_core.config.schema import ClusterConfig

        cluster = ClusterConfig()
    return cluster


def _enable_token_auth_if_available() -> None:
    """Use Ray's token auth when a token is at hand, as ``ray start`` and ``ray.init()`` do.

    Ray 2.5x+ enables token auth on clusters started while a token exists (~/.ray/auth_token),
    but a driver joining with an explicit address stays in "disabled" mode and is refused
    unless ``RAY_AUTH_MODE`` is set; an explicit ``RAY_AUTH_MODE`` is always respected.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # older Ray without token auth
        return
    # Best effort: ray.init reports a refused connection with its own message.
    with contextlib.suppress(Exception):
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class RayCluster:
    """Joins a running Ray cluster at ``cluster.address`` or ``$RAY_ADDRESS``; never stops it."""

    def __init__(self, options: Any = None, context: Any = None) -> None:
        self.options, self.context = options, context
        self.config = cluster_section(context)
        self._connected = False
        self.console_output = True
        """As :attr:`nrl_core.distributed.cluster.LocalCluster.console_output` (the cluster's workers keep their own
        environment: their progress bars are not turned off)."""
        self._output: RayOutputToRunLog | None = None

    @property
    def address(self) -> str | None:
        return self.config.address or os.environ.get("RAY_ADDRESS") or None

    def start(self) -> ClusterResources:
        """Connect this process to the cluster and return its resources."""
        import ray

        from nrl_core.distributed.actor_env import check_image_manifest

        check_image_manifest()
        address = self.address
        if address is None:
            raise ClusterError(
                "cluster.backend=ray needs cluster.address or RAY_ADDRESS; start "
                "a cluster with `ray start --head` or use cluster.backend=local"
            )
        _enable_token_auth_if_available()
        if not self.console_output:
            self._output = RayOutputToRunLog()
        try:
            ray.init(
                address=address,
                log_to_driver=self._output is None or self._output.forwarding,
            )
        except Exception as exc:
            self._remove_output()
            raise ClusterError(
                f"cannot connect to the Ray cluster at {address}: {exc}; check "
                "that `ray status --address ADDRESS` works from this node"
            ) from exc
        self._connected = True
        return ray_resources()

    def shutdown(self) -> None:
        """Disconnect this process; the cluster keeps running."""
        if self._connected:
            import ray

            self._connected = False
            try:
                ray.shutdown()  # on a connected driver this only disconnects
            finally:
                self._remove_output()

    def _remove_output(self) -> None:
        if self._output is not None:
            self._output.remove()
            self._output = None
