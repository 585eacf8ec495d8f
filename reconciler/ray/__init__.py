"""The fabric's API for Ray drivers (issue 13; the seed's "Ray integration with the scheduler").

The one package that imports `ray` at import time (an import-linter contract
keeps it so; `ray` comes with the optional extra `ray`). It is a client of the
fabric, like the command line, and sits above it: it opens the registry
through `reconciler.wiring` as `fabric` does. The decisions are the core's
(`reconciler.core.scheduling.ray_tasks`, the scheduler's own rules); this
package only reads the live registry and Ray's node table, and pins each
call to the chosen Ray node:

    from reconciler.ray import Dispatcher, Requirement

    fabric = Dispatcher.connect("/etc/fabric")   # fabric.toml's registry, or a sqlite path, or an etcd URL
    assignment = fabric.select_worker(Requirement(min_tier="gpu_apu", payload_size=len(data)))
    ref = fabric.adaptive_remote(work, min_tier="gpu_apu").remote(data)   # raises CapacityError when deferred
    print(fabric.fallbacks.line())   # "100 tasks dispatched, fallback tiers used: N"

The leader's reader of Ray's state API (the `RayState` port: tasks running
per fabric host and dead Ray nodes) is an adapter, `reconciler.adapters.ray_state`,
which imports `ray` only when it reads.
"""

from reconciler.core.scheduling.ray_tasks import FallbackCount, NodeAssignment, Requirement
from reconciler.ray.dispatch import CapacityError, Dispatcher, open_fabric_registry, ray_node_ids

__all__ = [
    "CapacityError",
    "Dispatcher",
    "FallbackCount",
    "NodeAssignment",
    "Requirement",
    "open_fabric_registry",
    "ray_node_ids",
]
