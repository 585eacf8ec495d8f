"""Rules that span lanes (`[[backends]]`), and lanes and services.

Pure. Called by `load.fleet_rules`; each broken rule is a `Problem` naming
fabric.toml, the key path and the reason.

Compute agents may share a host (multi-compute.md: "If you ever run two
compute agents on one host"): each has its own agent_ref (a rule of
`fleet_rules`), unit (named by the lane id), queue, token file and scratch
dir, so one never takes the other's pushed files or jobs.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from reconciler.core.desired.model import PHAZE_QUEUE_PREFIX, FleetConfig, agent_token_file, lane_queue_name
from reconciler.core.desired.problems import Problem


def _within(inner: str, outer: str) -> bool:
    """Whether path `inner` is `outer` or below it."""
    a, b = PurePosixPath(inner), PurePosixPath(outer)
    return a == b or b in a.parents


def lane_rules(file: str, fleet: FleetConfig) -> list[Problem]:
    problems: list[Problem] = []
    backends = fleet.lanes
    compute = [(i, b) for i, b in enumerate(backends) if b.kind == "compute"]

    # Co-located agents: one scratch dir each. Nested dirs are one dir too:
    # the outer agent would see (and clean up) the inner one's pushed files.
    for n, (i, b) in enumerate(compute):
        for j, other in compute[:n]:
            if other.push_host != b.push_host or b.scratch_dir is None or other.scratch_dir is None:
                continue
            if _within(b.scratch_dir, other.scratch_dir) or _within(other.scratch_dir, b.scratch_dir):
                same = "is" if b.scratch_dir == other.scratch_dir else "overlaps"
                problems.append(
                    Problem(
                        file,
                        f"backends[{i}].scratch_dir",
                        f"{b.scratch_dir!r} {same} the scratch_dir of backends[{j}] ({other.id!r}, {other.scratch_dir!r}) "
                        f"on the same push_host {b.push_host!r}: agents on one host need a scratch_dir each",
                    )
                )
                break

    # One token per agent: phaze's worker checks the token's agent id against its queue.
    first_token: dict[str, int] = {}
    for i, b in compute:
        path = agent_token_file(fleet.agent, b)
        assert path is not None  # a compute lane
        j = first_token.setdefault(path, i)
        if j != i:
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].token_file",
                    f"{path!r} is also the token file of backends[{j}] ({backends[j].id!r}): each agent needs its own token",
                )
            )

    # A lane's agent and a service both run as fabric-agent-<id>.service.
    service_index = {s.id: k for k, s in enumerate(fleet.services)}
    for i, b in enumerate(backends):
        k = service_index.get(b.id)
        if k is not None:
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].id",
                    f"{b.id!r} is also the id of services[{k}]: a lane's agent and a service would both be fabric-agent-{b.id}.service",
                )
            )

    own = _own_lane_queues(file, fleet)
    if own:
        return problems + own

    # The local lane is phaze's own processing: its queue must not be one an agent consumes.
    if fleet.agent is not None:
        prefix = fleet.agent.queue_prefix
        for i, b in enumerate(backends):
            if b.kind == "local" and b.queue is not None and b.queue.startswith(prefix):
                problems.append(
                    Problem(
                        file,
                        f"backends[{i}].queue",
                        f"{b.queue!r} is an agent's queue (agent.queue_prefix {prefix!r}); the local lane's queue is the file server's own",
                    )
                )
    return problems


def _own_lane_queues(file: str, fleet: FleetConfig) -> list[Problem]:
    """The fabric's own lanes (no [phaze] api_url): it writes jobs into their
    queues, so none may be phaze's (phaze-agent-*, phaze dispatches there)."""
    if fleet.phaze_dispatches:
        return []
    problems = []
    for i, b in enumerate(fleet.lanes):
        queue = lane_queue_name(fleet, b)
        if queue is not None and queue.startswith(PHAZE_QUEUE_PREFIX):
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].queue",
                    f"{queue!r} is phaze's (its agents' queues, where phaze's control plane dispatches): "
                    "the fabric's own lanes use queues of their own, or give [phaze] api_url to make this a phaze fleet",
                )
            )
    return problems


def local_lane_rules(file: str, fleet: FleetConfig) -> list[Problem]:
    """A phaze fleet's local lane: phaze's LocalBackend dispatches onto the
    file server agent's own lane queue, so its queue is named by [phaze]
    fileserver_agent, never by a `queue` of its own (phaze has no other)."""
    if not fleet.phaze_dispatches:
        return []
    problems = []
    for i, b in enumerate(fleet.lanes):
        if b.kind != "local":
            continue
        if b.queue is not None:
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].queue",
                    "not used in a phaze fleet ([phaze] api_url): phaze's local lane is the file server agent's own queue, "
                    "phaze-agent-<[phaze] fileserver_agent>-<agent_lane>; phaze has no other local queue",
                )
            )
        elif fleet.phaze.fileserver_agent is None:
            problems.append(
                Problem(
                    file,
                    "phaze.fileserver_agent",
                    f"required for the local lane backends[{i}] in a phaze fleet: its queue is phaze-agent-<fileserver_agent>-<agent_lane> "
                    "(phaze's LocalBackend dispatches onto the file server agent's queue)",
                )
            )
    return problems


def compute_lane_rules(file: str, fleet: FleetConfig) -> list[Problem]:
    """A compute lane's ssh_user (its own or [phaze] push_ssh_user) and, in a
    phaze fleet, no `queue` of its own (phaze names its agents' queues)."""
    problems = local_lane_rules(file, fleet)
    for i, b in enumerate(fleet.lanes):
        if b.kind != "compute":
            continue
        if b.ssh_user is None and fleet.phaze.push_ssh_user is None:
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].ssh_user",
                    "required for a compute lane unless [phaze] push_ssh_user gives the fleet-wide default: "
                    "its scratch_dir belongs to the user phaze pushes as",
                )
            )
        if b.queue is not None and fleet.phaze_dispatches:
            problems.append(
                Problem(
                    file,
                    f"backends[{i}].queue",
                    f"not used in a phaze fleet ([phaze] api_url): phaze's agent consumes {lane_queue_name(fleet, b)} (phaze-agent-<agent_ref>-<agent_lane>)",
                )
            )
    return problems
