"""Ray's state API as the leader reads it: the `RayState` port's real adapter.

One `observe()` lists the cluster's nodes (alive or dead, each with the host
label the fabric rendered) and its running tasks, and counts those per
fabric host. It goes through Ray's state API (the dashboard's, so the head
runs with `ray[default]`), addressed like `ray status --address`: no driver
joins the cluster, so the leader adds no load and holds no job.
"""

from __future__ import annotations

from collections import Counter

from reconciler.core.render.ray_node import HOST_LABEL
from reconciler.core.scheduling.ray_tasks import RayView
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
        # Only a live node runs anything: a task that ran on a node that died
        # stays RUNNING in the state API's task events (no final event came).
        live_host: dict[str, str] = {}
        alive: set[str] = set()
        dead: set[str] = set()
        for node in nodes:
            host = (node.labels or {}).get(HOST_LABEL)
            if not host:
                continue
            if node.state == "ALIVE":
                live_host[node.node_id] = host
                alive.add(host)
            else:
                dead.add(host)
        per_host = Counter(live_host[task.node_id] for task in running if task.node_id in live_host)
        return RayView(running=dict(per_host), alive=frozenset(alive), dead=frozenset(dead - alive))
