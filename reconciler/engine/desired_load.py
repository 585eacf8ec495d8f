"""How much of the desired state a pass loads: the whole tree once per commit, then a few files.

    loaded = load_for_pass(directory, host, commit=..., verdict=..., may_lead=...)
    desired = with_plan_hosts(loaded, plan, snapshot)   before rendering
    record_verdict(tree, state_dir, loaded)        once the pass's inputs all checked out

The whole tree (fabric.toml, every host file, and the rules that span files)
is validated the first time a pass sees a desired-state commit; bad input
anywhere in it is refused then, as always (exit 2, nothing changed). The
verdict is kept in the state directory under the commit's key
(adapters.memo_io.git_commit: the commit and the stat of git's index, so a
checkout moved to another commit, or re-checked-out, is a new key), with the
one index a partial load of the edge needs from the whole tree: the hosts
with role control (the local lane's jobs run on the first). At a commit
with a verdict, a host that may not lead reads fabric.toml, its own host
file, its port maps' targets', its Ray head's (a `[ray]` worker) and the files
of the hosts its plan places services on, each validated on its own
(`named_hosts`); the edge adds the control hosts, the lanes' hosts, the
leader candidates and the nodes of the registry's snapshot, which its status
page and metrics show (`with_plan_hosts`). Its pass then costs the same in a
fleet of five or of ten thousand declared hosts.

A leader candidate whose pass may lead (the leader step schedules over every
host) loads the whole tree on every pass, as does any pass over a directory
that is not a git checkout: there is no commit to key a verdict by, and a
stat fingerprint of the tree would cost a stat per host file, growing with
the fleet, to save a validation on trees that are edited by hand (a
development tree, a test) and whose every edit the operator expects checked at once.

An uncommitted edit of another host's file in a checkout with a verdict is not
seen by a host that does not read that file; the leader (which loads every
file), `fabric validate` and the next commit see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import reconciler
from reconciler.core.desired.load import load_desired, load_hosts_of
from reconciler.core.desired.model import DesiredState, FleetConfig
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.render.plan_part import hosts_the_part_reads
from reconciler.ports import FileTree

# In the state directory: {"directory": ..., "commit": ..., "version": ...}, the last
# whole tree found valid, and by which version of the rules: an upgraded
# reconciler (new or stricter rules) validates the whole tree again.
VERDICT_FILE = "desired-verdict.json"


@dataclass(frozen=True)
class LoadedDesired:
    desired: DesiredState
    directory: Path
    # Only some host files were read (with_plan_hosts adds the plan's).
    partial: bool
    # The commit key this pass validated the whole tree at, to record as its verdict.
    validated: str | None


def _validated(raw: bytes | None, directory: Path, commit: str) -> tuple[str, ...] | None:
    """The control hosts of the whole tree of `directory` found valid at
    `commit` (the verdict's index), or None: no such verdict."""
    if raw is None:
        return None
    try:
        verdict = json.loads(raw)
    except ValueError:
        return None
    if not (
        isinstance(verdict, dict)
        and verdict.get("commit") == commit
        and verdict.get("directory") == str(directory.absolute())
        and verdict.get("version") == reconciler.__version__
    ):
        return None
    control = verdict.get("control")
    if not isinstance(control, list) or not all(isinstance(name, str) for name in control):
        return None  # a verdict without its index: validate again, which writes one
    return tuple(control)


def named_hosts(fleet: FleetConfig, host: str, control: Iterable[str], *, edge: bool) -> set[str]:
    """The hosts whose files a pass of `host` reads beside its own, before the
    plan: the targets of its port maps, its Ray head (its Ray worker joins the
    head's address) and, for the edge (its status page and metrics show them),
    the control hosts (where the local lane's jobs run), the hosts of the lanes
    and the leader candidates. The edge's page lists these, the plan's and the
    registry's nodes (engine.pass_records.page_hosts)."""
    names = {host} | {m.target_host for m in fleet.port_maps if m.host == host}
    ray = fleet.ray
    if ray is not None and host in ray.workers:
        names.add(ray.head)
    if edge:
        names |= set(control)
        names |= {lane.push_host for lane in fleet.lanes if lane.kind == "compute" and lane.push_host}
        names |= set(fleet.fleet.leader_candidates)
    return names


def load_for_pass(directory: Path, host: str, *, commit: str | None, verdict: bytes | None, may_lead: bool) -> LoadedDesired:
    """The desired state this pass needs; raises DesiredStateError (every problem of what it read)."""
    control = _validated(verdict, directory, commit) if commit is not None else None
    if control is None:
        return LoadedDesired(load_desired(directory), directory, partial=False, validated=commit)
    first = load_hosts_of(directory, [host])
    own = first.hosts.get(host)
    if own is None or (may_lead and host in first.fleet.fleet.leader_candidates):
        # Not declared (the whole tree's message lists the hosts), or a pass that may lead.
        return LoadedDesired(load_desired(directory), directory, partial=False, validated=None)
    names = named_hosts(first.fleet, host, control, edge="edge" in own.host.roles)
    desired = load_hosts_of(directory, names, fleet=first.fleet, loaded=dict(first.hosts))
    return LoadedDesired(desired, directory, partial=True, validated=None)


def with_plan_hosts(loaded: LoadedDesired, plan: FleetPlan, snapshot: Snapshot | None = None) -> DesiredState:
    """The desired state with the files of the hosts `plan` places services on
    (render checks each placement against the declared hosts) and, for the
    edge, of the nodes of the registry's `snapshot` (its page tells a declared
    node from one that is not)."""
    if not loaded.partial:
        return loaded.desired
    desired = loaded.desired
    nodes = {p.node for p in plan.placements} | ({n.node_id for n in snapshot.nodes} if snapshot is not None else set())
    if nodes <= set(desired.hosts):
        return desired
    return load_hosts_of(loaded.directory, nodes, fleet=desired.fleet, loaded=dict(desired.hosts))


def host_files_read(desired: DesiredState, host: str, plan: FleetPlan) -> tuple[str, ...]:
    """The host files beside `host`'s own its pass's artifacts depend on, as
    paths relative to the desired-state directory (both places a host file
    may be): the hosts it names (`named_hosts`) and those its part of `plan`
    reads (on the edge, its routed services' nodes). The pass memo stats
    them for a plain directory (`memoized_pass.desired_digest`)."""
    own = desired.hosts.get(host)
    edge = own is not None and "edge" in own.host.roles
    names = named_hosts(desired.fleet, host, desired.hosts_with_role("control"), edge=edge) | hosts_the_part_reads(desired, plan, host)
    names.discard(host)
    return tuple(path for name in sorted(names) for path in (f"{name}.toml", f"hosts/{name}.toml"))


def load_own(directory: Path, host: str) -> DesiredState:
    """fabric.toml and this host's file: what `fabric watch` reads at each new
    plan to know what its part is read from (`engine.watch`). Raises DesiredStateError."""
    return load_hosts_of(directory, [host])


def load_for_part(directory: Path, host: str, plan: FleetPlan) -> DesiredState:
    """What `fabric watch` computes `host`'s part of `plan` under: fabric.toml,
    this host's file and, on the edge, the files of the nodes its routed
    services are placed on (render leaves out a placement on an undeclared
    host). A few files per new plan, however large the fleet; each validated
    on its own, as a pass at a validated commit does. Raises DesiredStateError."""
    own = load_hosts_of(directory, [host])
    return load_hosts_of(directory, hosts_the_part_reads(own, plan, host), fleet=own.fleet, loaded=dict(own.hosts))


def record_verdict(tree: FileTree, state_dir: str, loaded: LoadedDesired) -> None:
    """Keep the verdict on the whole tree this pass validated (it was valid), keyed by its commit."""
    if loaded.validated is None:
        return
    verdict = {
        "directory": str(loaded.directory.absolute()),
        "commit": loaded.validated,
        "version": reconciler.__version__,
        "control": loaded.desired.hosts_with_role("control"),
    }
    tree.write(f"{state_dir}/{VERDICT_FILE}", json.dumps(verdict).encode())


def read_verdict(tree: FileTree, state_dir: str) -> bytes | None:
    return tree.read(f"{state_dir}/{VERDICT_FILE}")
