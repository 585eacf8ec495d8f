"""Ray's state API as the leader reads it: the `RayState` port's real adapter.

One `observe()` lists the cluster's nodes (alive or dead, each with the host
label the fabric rendered) and its running tasks, and counts those per
fabric host. It goes through Ray's state API (the dashboard's, so the head
runs with `ray[default]`), addressed like `ray status --address`: no driver
joins the cluster, so the leader adds no load and holds no job. `ray` is
imported inside `observe` only: the adapters load without the `ray` extra.
"""

from __future__ import annotations

from reconciler.core.render.ray_node import HOST_LABEL
from reconciler.core.scheduling.ray_tasks import RayView, ray_view
from reconciler.ports import RayStateUnavailable


class RayStateReader:
    """`RayState` over the Ray cluster at `address` (a GCS address "host:port", or "auto")."""

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def observe(self) -> RayView:
        try:
            from ray.util.state import list_nodes, list_tasks

            nodes = list_nodes(address=self.address, timeout=self.timeout_s, detail=True, raise_on_missing_output=False)
            running = list_tasks(
                address=self.address, filters=[("state", "=", "RUNNING")], timeout=self.timeout_s, limit=10_000, raise_on_missing_output=False
            )
        except Exception as exc:  # the state API raises its own errors, ConnectionError and timeouts alike
            raise RayStateUnavailable(f"ray state at {self.address}: {exc}") from exc
        return ray_view(((n.node_id, n.state == "ALIVE", n.labels or {}) for n in nodes), (t.node_id for t in running), host_label=HOST_LABEL)
