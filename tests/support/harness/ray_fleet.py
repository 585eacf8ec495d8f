"""A real multi-node Ray cluster built as the fabric renders it, for the Ray tests and bench/ray_dispatch.

`ray.cluster_utils.Cluster` on this machine: a bare head (no CPUs, no tiers,
no host label: never a candidate) and one Ray node per replayed probe of
qfox-1, a1-arm64 and lux, each with exactly the resources and labels
`render.ray_node.ray_node_spec` gives for the host's effective facts and
limits (lux's tier is pinned to cpu_ffmpeg by its host file) but
`num_cpus=1` (four raylets on a 2-core machine). The hosts' heartbeats
(`engine.heartbeat.node_record` of the same facts) are in a real sqlite
registry of the example fleet (signed plans: `signed.signer(host)`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.cluster_utils import Cluster

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.render.ray_node import RayNodeSpec, ray_node_spec
from reconciler.engine.heartbeat import node_record
from reconciler.engine.plan_source import effective_facts
from reconciler.wiring import open_registry
from tests.support.plan_keys import SignedFleet, signed_example_fleet

PROBES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"
HOSTS = ("qfox-1", "a1-arm64", "lux")
# The smallest object store Ray accepts: four raylets share this machine's memory.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
T = TypeVar("T")
# Ray gives a starting node a fixed 30 s to register with its GCS (node.py's
# raylet_start_wait_time_s, not configurable). On a loaded 2-core CI machine the
# head has missed it once (2026-12-01: "The current node timed out during
# startup"); a missed start, of the head or a node, is stopped by PID and tried again.
START_ATTEMPTS = 3
# The head waits for its GCS server to write its port file: 30 s by default
# (RAY_gcs_server_port_wait_time_s, read by the starting process). Once, in
# the suite's last phase (2026-12-02), the GCS wrote nothing in 30 s; a
# start is given Ray's own figure for a slow store, 120 s, instead.
GCS_PORT_WAIT_S = 120
HEAD_NODE_ARGS = {"num_cpus": 0, "include_dashboard": True, "object_store_memory": OBJECT_STORE_BYTES}


@dataclass
class RayFleet:
    desired: DesiredState
    registry_path: Path
    cluster: Cluster
    specs: dict[str, RayNodeSpec]
    signed: SignedFleet
    nodes: dict[str, Any] = field(default_factory=dict)

    def ray_node_id(self, host: str) -> str:
        return str(self.nodes[host].node_id)

    def host_of_node(self) -> dict[str, str]:
        return {node.node_id: host for host, node in self.nodes.items()}


def replayed(desired: DesiredState, host: str) -> HostFacts:
    facts = HostFacts.model_validate(json.loads((PROBES / host / "expected.json").read_text()))
    return effective_facts(desired, host, facts)


def ray_node_args(spec: RayNodeSpec) -> dict[str, Any]:
    """The rendered node, with one CPU."""
    return {
        "num_cpus": 1,
        "num_gpus": spec.num_gpus,
        "resources": dict(spec.resources),
        "labels": dict(spec.labels),
        "memory": spec.memory_bytes,
        "object_store_memory": OBJECT_STORE_BYTES,
    }


@contextmanager
def ray_fleet(tmp: Path) -> Iterator[RayFleet]:
    """The registry, the cluster, and this process connected to it as a driver; all stopped after."""
    signed = signed_example_fleet(tmp / "fleet")
    desired = load_desired(signed.desired)
    registry_path = tmp / "registry.sqlite"
    registry = open_registry(desired.fleet, sqlite_path=registry_path)
    specs = {}
    try:
        for host in HOSTS:
            facts = replayed(desired, host)
            # The hosts' own beats, alive for a day (the leader must not mark them offline).
            registry.heartbeat(node_record(desired, host, facts), ttl_s=86_400)
            specs[host] = ray_node_spec(host, facts, effective_limits(desired.hosts[host], facts.limitations))
    finally:
        registry.close()
    cluster = started_head()
    fleet = RayFleet(desired, registry_path, cluster, specs, signed)
    try:
        for host, spec in specs.items():
            fleet.nodes[host] = registered(host, lambda spec=spec: cluster.add_node(**ray_node_args(spec)))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, logging_level="warning")
        yield fleet
    finally:
        ray.shutdown()
        cluster.shutdown()


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (the raylets, GCS and dashboard a start forked)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(child) for child in (task / "children").read_text().split()}
            except OSError:
                continue
            frontier.extend(children - found)
            found |= children
    return found


def started_head() -> Cluster:
    """A cluster with its head up (see `registered`), its GCS given GCS_PORT_WAIT_S to start."""
    before = os.environ.get("RAY_gcs_server_port_wait_time_s")
    os.environ["RAY_gcs_server_port_wait_time_s"] = str(GCS_PORT_WAIT_S)
    try:
        return registered("head", lambda: Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS))
    finally:
        if before is None:
            del os.environ["RAY_gcs_server_port_wait_time_s"]
        else:
            os.environ["RAY_gcs_server_port_wait_time_s"] = before


def registered(what: str, start: Callable[[], T]) -> T:
    """`start()`, tried again when its node missed Ray's registration window; the missed start's processes are killed and reaped by PID."""
    for attempt in range(1, START_ATTEMPTS + 1):
        before = descendants(os.getpid())
        try:
            return start()
        except Exception as missed:  # Ray raises a bare Exception for the missed window
            if "timed out during startup" not in str(missed) or attempt == START_ATTEMPTS:
                raise
            print(f"ray {what} start {attempt}/{START_ATTEMPTS} missed Ray's 30 s window; killing it and retrying", file=sys.stderr)
            stray = descendants(os.getpid()) - before
            for pid in stray:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in stray:  # reap our own children; the kernel reparents the rest
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
    raise AssertionError("unreachable")
