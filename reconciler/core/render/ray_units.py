"""The Ray node units of one host: `fabric-ray-head.service` on `[ray] head`,
`fabric-ray-worker.service` on each of `[ray] workers` (pure).

What the node offers is `ray_node.ray_node_spec` of the host's live probe and
effective limits, the single source it shares with anything that builds a Ray
node for a host. The unit runs `ray start --block` with that spec as flags:

- `--num-cpus` / `--num-gpus` / `--memory` / `--resources` (JSON) /
  `--labels` (Ray 2.60's "key=value,key=value" form);
- `--node-ip-address`: the host's declared tailnet address (from its host
  file, like every address the fabric renders: the registry never supplies
  one), and `--address <head's tailnet address>:<port>` for a worker;
- `--temp-dir` under the unit's state directory: the dynamic user's own,
  where a driver on the same host finds the node's session and sockets (the
  unit's /tmp is private to it).

A change of any of those (a tier, the limits, a GPU) changes ExecStart=, so
the pure compare of units (`actions.compare_units`) restarts that host's node
and no other unit.

A node that takes no new work (drained, or held off for flapping: the
scheduler's `accepts_new_work`) is closed to new Ray tasks the same way: its
unit is rendered with no CPUs, no GPUs and no tier resources, so Ray's
scheduler places nothing new there (every fabric task asks for a tier
resource, and a plain task for a CPU), while the node stays in the cluster
with its labels, so a driver still sees which fabric host it is. The restart
that change causes ends the node's running tasks; Ray retries them elsewhere
(a task's `max_retries`). Ray 2.60's `ray drain-node` would keep them running,
but a drain there cannot be lifted (the node must be restarted to take work
again) and needs the node's Ray id, which only a running cluster knows: a pure
render cannot give it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from reconciler.core.desired.model import DesiredState, HostFacts, RaySettings
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.live.models import SnapshotNode
from reconciler.core.render.ray_node import RAY_HEAD_UNIT, RAY_WORKER_UNIT, RayNodeSpec, ray_node_spec
from reconciler.core.scheduling.lifecycle import NodeState, snapshot_node
from reconciler.core.scheduling.placement import accepts_new_work
from reconciler.core.timestamps import utc, utc_stamp

RayRole = Literal["head", "worker"]

# Where a `ray` found nowhere else is expected (the unit then names what to install).
DEFAULT_RAY_COMMAND = "/usr/bin/ray"


@dataclass(frozen=True)
class RayUnit:
    """One rendered Ray node unit, before quoting: its name, role and argv."""

    unit: str
    role: RayRole
    spec: RayNodeSpec
    argv: tuple[str, ...]
    state_directory: str
    closed: str | None


def ray_role(ray: RaySettings | None, host: str) -> RayRole | None:
    """The Ray node `host` runs: the head, a worker, or none."""
    if ray is None:
        return None
    if host == ray.head:
        return "head"
    return "worker" if host in ray.workers else None


def closed_reason(state: NodeState | None, now: datetime) -> str | None:
    """Why this node takes no new Ray tasks (the scheduler's rule for new
    placements: drained, held off), or None when it takes them."""
    if state is None:
        return None
    node = snapshot_node(state)
    if node is None:
        node = SnapshotNode(node_id=state.node_id, tier="relay", status=state.status, drained=state.drained, held_off_until=state.held_off_until)
    if accepts_new_work(node, utc(now)):
        return None
    if node.drained:
        return "drained"
    if node.held_off_until is not None and utc(node.held_off_until) > utc(now):
        return f"held off until {utc_stamp(node.held_off_until)}"
    return node.status


def closed_spec(spec: RayNodeSpec) -> RayNodeSpec:
    """The node as it stays in the cluster while closed: labels, nothing to offer."""
    return RayNodeSpec(host=spec.host, tier=spec.tier, num_cpus=0, num_gpus=0, memory_bytes=spec.memory_bytes, resources={}, labels=spec.labels)


def ray_labels(labels: dict[str, str]) -> str:
    """`ray start --labels`: "key=value,key=value" (keys and values hold no ',' or '=')."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def ray_unit(desired: DesiredState, host: str, facts: HostFacts, ray_command: str, closed: str | None = None) -> RayUnit | None:
    """The Ray node unit `host` runs, or None when it runs none."""
    ray = desired.fleet.ray
    role = ray_role(ray, host)
    if ray is None or role is None:
        return None
    spec = ray_node_spec(host, facts, effective_limits(desired.hosts[host], facts.limitations))
    offered = closed_spec(spec) if closed is not None else spec
    unit = RAY_HEAD_UNIT if role == "head" else RAY_WORKER_UNIT
    state_directory = unit.removesuffix(".service")
    address = desired.hosts[host].host.address
    argv = [ray.command or ray_command, "start", "--block"]
    if role == "head":
        argv += ["--head", f"--port={ray.port}"]
        if ray.dashboard:
            argv += ["--include-dashboard=true", f"--dashboard-host={address}", f"--dashboard-port={ray.dashboard_port}"]
        else:
            argv += ["--include-dashboard=false"]
    else:
        head_address = desired.hosts[ray.head].host.address
        argv += [f"--address={head_address}:{ray.port}"]
    argv += [
        f"--node-ip-address={address}",
        f"--num-cpus={offered.num_cpus}",
        f"--num-gpus={offered.num_gpus}",
    ]
    if offered.memory_bytes is not None:
        argv.append(f"--memory={offered.memory_bytes}")
    argv += [
        f"--resources={json.dumps(offered.resources, sort_keys=True, separators=(',', ':'))}",
        f"--labels={ray_labels(offered.labels)}",
        f"--temp-dir=/var/lib/{state_directory}/tmp",
        "--disable-usage-stats",
    ]
    return RayUnit(unit, role, offered, tuple(argv), state_directory, closed)


@dataclass(frozen=True)
class RayStateSource:
    """Where the leader reads Ray's state API for the fleet's Ray cluster:
    `address` (the head's dashboard, which serves that API), or None with
    the `note` that says why Ray's tasks are not in the load."""

    address: str | None
    note: str | None = None


def ray_state_source(desired: DesiredState) -> RayStateSource:
    """The `[ray]` head's state API, as `fabric leader run` reads it when not
    given `--ray-address`: the dashboard on the head's tailnet address. Without
    `[ray]` there is nothing to read; with the dashboard off there is no state
    API (Ray serves it from the dashboard), which the leader says once."""
    ray = desired.fleet.ray
    if ray is None:
        return RayStateSource(None)
    if not ray.dashboard:
        return RayStateSource(
            None,
            f"{desired.fleet_file}: ray.dashboard is off, so Ray's state API does not run: "
            "Ray's tasks are not counted in the hosts' load (set ray.dashboard = true, or give --ray-address)",
        )
    head = desired.hosts[ray.head].host.address
    return RayStateSource(f"http://{head}:{ray.dashboard_port}")
