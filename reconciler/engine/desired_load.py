"""How much of the desired state a pass loads: the whole tree once per commit, then a few files.

    loaded = load_for_pass(directory, host, commit=..., verdict=..., may_lead=...)
    desired = with_plan_hosts(loaded, plan)        before rendering
    record_verdict(tree, state_dir, loaded)        once the pass's inputs all checked out

The whole tree (fabric.toml, every host file, and the rules that span files)
is validated the first time a pass sees a desired-state commit; bad input
anywhere in it is refused then, as always (exit 2, nothing changed). The
verdict is kept in the state directory under the commit's key
(adapters.memo_io.git_commit: the commit and the stat of git's index, so a
checkout moved to another commit, or re-checked-out, is a new key). At a
commit with a verdict, a host that neither may lead nor serves the edge reads
fabric.toml, its own host file, the files of its port maps' targets, of its
Ray head (a `[ray]` worker) and of the hosts its plan places services on, each validated on its own: its pass
then costs the same in a fleet of five or of ten thousand hosts.

A leader candidate (its pass may take the leader step, which schedules over
every host) and the edge (its status page lists every declared host) load the
whole tree on every pass, as does any pass over a directory that is not a git
checkout: there is no commit to key a verdict by, and a stat fingerprint of
the tree would cost a stat per host file, growing with the fleet, to save a
validation on trees that are edited by hand (a development tree, a test) and
whose every edit the operator expects checked at once.

An uncommitted edit of another host's file in a checkout with a verdict is not
seen by a host that does not read that file; the leader (which loads every
file), `fabric validate` and the next commit see it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import reconciler
from reconciler.core.desired.load import load_desired, load_hosts_of
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
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


def _validated(raw: bytes | None, directory: Path, commit: str) -> bool:
    """Whether the whole tree of `directory` was found valid at `commit`."""
    if raw is None:
        return False
    try:
        verdict = json.loads(raw)
    except ValueError:
        return False
    return (
        isinstance(verdict, dict)
        and verdict.get("commit") == commit
        and verdict.get("directory") == str(directory.absolute())
        and verdict.get("version") == reconciler.__version__
    )


def load_for_pass(directory: Path, host: str, *, commit: str | None, verdict: bytes | None, may_lead: bool) -> LoadedDesired:
    """The desired state this pass needs; raises DesiredStateError (every problem of what it read)."""
    if commit is None or not _validated(verdict, directory, commit):
        return LoadedDesired(load_desired(directory), directory, partial=False, validated=commit)
    first = load_hosts_of(directory, [host])
    own = first.hosts.get(host)
    if own is None or "edge" in own.host.roles or (may_lead and host in first.fleet.fleet.leader_candidates):
        # Not declared (the whole tree's message lists the hosts), the edge, or a pass that may lead.
        return LoadedDesired(load_desired(directory), directory, partial=False, validated=None)
    targets = {m.target_host for m in first.fleet.port_maps if m.host == host}
    ray = first.fleet.ray
    if ray is not None and host in ray.workers:
        targets.add(ray.head)  # its Ray worker joins the head's address
    desired = load_hosts_of(directory, targets, fleet=first.fleet, loaded=dict(first.hosts))
    return LoadedDesired(desired, directory, partial=True, validated=None)


def with_plan_hosts(loaded: LoadedDesired, plan: FleetPlan) -> DesiredState:
    """The desired state with the files of the hosts `plan` places services on
    (render checks each placement against the declared hosts)."""
    if not loaded.partial:
        return loaded.desired
    desired = loaded.desired
    nodes = {p.node for p in plan.placements}
    if nodes <= set(desired.hosts):
        return desired
    return load_hosts_of(loaded.directory, nodes, fleet=desired.fleet, loaded=dict(desired.hosts))


def record_verdict(tree: FileTree, state_dir: str, loaded: LoadedDesired) -> None:
    """Keep the verdict on the whole tree this pass validated (it was valid), keyed by its commit."""
    if loaded.validated is None:
        return
    verdict = {"directory": str(loaded.directory.absolute()), "commit": loaded.validated, "version": reconciler.__version__}
    tree.write(f"{state_dir}/{VERDICT_FILE}", json.dumps(verdict).encode())


def read_verdict(tree: FileTree, state_dir: str) -> bytes | None:
    return tree.read(f"{state_dir}/{VERDICT_FILE}")
