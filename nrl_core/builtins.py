"""The core's own components, registered through the same plugin manager as third parties."""

from nrl_core import hookimpl


@hookimpl
def nrl_register_clusters(register):
    register("local", "nrl_core.distributed.cluster:LocalCluster",
             description="starts a Ray head in this process; shut down when the run ends")
    register("ray", "nrl_core.distributed.cluster:RayCluster",
             description="joins a running Ray cluster (cluster.address or RAY_ADDRESS)")
