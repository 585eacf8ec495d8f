"""Who may do what on phaze's broker (SAQ on PostgreSQL): roles by what each
component needs, from the desired state.

`broker_roles(desired)` is what the broker's database should hold;
`role_steps(want, have)` the changes that take it there (`fabric lane
init-roles` applies them with the tables' owner's DSN, and reads `have` from
PostgreSQL's catalogs). The tables (reconciler/adapters/lane_broker_pg.py):

    fabric-reader        SELECT on saq's tables and the fabric's: what a pass
                         (a lane host's heartbeat, its in_flight), `fabric
                         status` and `fabric lane status` read; every row
    fabric-dispatcher    the leader candidates (the leader's dispatch, `fabric
                         lane dispatch` and `enqueue`): the fabric's tables
                         (fabric_lane_jobs, its sequence, the fence row: SELECT
                         and UPDATE, no INSERT or DELETE), saq_jobs and its
                         sequence (put a job on a lane's queue, settle, set a
                         crashed run aside: SELECT, INSERT, UPDATE, DELETE),
                         saq_stats (SELECT)
    fabric-agent-<lane>  the SAQ workers of one lane (a compute lane's agent,
                         the local lane's processing): saq_jobs SELECT, UPDATE,
                         DELETE and saq_stats SELECT, INSERT, UPDATE, DELETE,
                         each only on rows of the lane's own queue (row-level
                         security: a policy per role); its set-aside runs too
                         (SUPERSEDED_QUEUE, whatever lane they were on: what a
                         worker finishes there is ignored). No INSERT of jobs:
                         an agent takes and finishes jobs, it never makes any.
                         A schema of its own holds a view of saq's version table
                         first on its search_path: saq's worker runs `CREATE
                         TABLE IF NOT EXISTS` on connect, which PostgreSQL
                         checks against the schema it would create in, so the
                         agent may create only there (where only it looks)

Row-level security is switched on for saq_jobs and saq_stats; the reader and
the dispatcher get a policy for every row. The tables' owner (phaze's own
DSN, which made them) is not subject to it. Nobody but the dispatcher may
write the fence row, and even its number decides nothing: the dispatch fence
is the registry's term, read inside each dispatch (engine.dispatch).

Only roles named fabric-* are managed: a privilege of such a role on these
tables that is not wanted is revoked (a lane that left the desired state
keeps its role, with nothing granted); policies named fabric-* that are not
wanted are dropped. Roles are never dropped and get no password here: set
one, or authenticate them in pg_hba.conf, and write each role's DSN into the
file its component reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from reconciler.core.desired.model import DesiredState, agent_queue_name, lane_queue_name

READER = "fabric-reader"
DISPATCHER = "fabric-dispatcher"
AGENT_PREFIX = "fabric-agent-"
MANAGED_PREFIX = "fabric-"
# PostgreSQL's longest identifier (NAMEDATALEN - 1 bytes).
MAX_IDENTIFIER = 63

# The broker's tables (saq 0.26's and the fabric's: adapters.lane_broker_pg).
SAQ_JOBS = "saq_jobs"
SAQ_STATS = "saq_stats"
SAQ_VERSIONS = "saq_versions"
LANE_JOBS = "fabric_lane_jobs"
LANE_JOBS_SEQ = "fabric_lane_jobs_seq_seq"
SAQ_JOBS_SEQ = "saq_jobs_lock_key_seq"
LANE_FENCE = "fabric_lane_fence"
# Where a run settled as crashed is set aside (adapters.lane_broker_pg.SUPERSEDED_QUEUE).
SUPERSEDED_QUEUE = "fabric-superseded"

TABLES = (SAQ_JOBS, SAQ_STATS, SAQ_VERSIONS, LANE_JOBS, LANE_FENCE)
SEQUENCES = (SAQ_JOBS_SEQ, LANE_JOBS_SEQ)
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
SEQUENCE_PRIVILEGES = ("USAGE", "SELECT", "UPDATE")
# The tables whose rows an agent sees only of its own queue, and the column naming it.
ROW_SECURED = {SAQ_JOBS: "queue", SAQ_STATS: "queue_key"}


def privileges_of(obj: str) -> tuple[str, ...]:
    return SEQUENCE_PRIVILEGES if obj in SEQUENCES else TABLE_PRIVILEGES


def agent_role(lane_id: str) -> str:
    """The role of one lane's workers: fabric-agent-<lane id>, shortened with a
    digest of the id when PostgreSQL would truncate it."""
    name = f"{AGENT_PREFIX}{lane_id}"
    if len(name.encode()) <= MAX_IDENTIFIER:
        return name
    digest = hashlib.sha256(lane_id.encode()).hexdigest()[:8]
    return f"{name[: MAX_IDENTIFIER - 9]}-{digest}"


@dataclass(frozen=True)
class BrokerRole:
    """One role the broker should hold: what it is for, its privileges per
    table (or sequence), and the queues whose rows of ROW_SECURED it may
    touch (None: every row)."""

    name: str
    purpose: str
    privileges: Mapping[str, frozenset[str]]
    queues: tuple[str, ...] | None = None

    @property
    def own_schema(self) -> bool:
        """An agent: a schema of its own, first on its search_path (module docstring)."""
        return self.queues is not None


def _privileges(**tables: str) -> dict[str, frozenset[str]]:
    return {table: frozenset(spec.split()) for table, spec in tables.items()}


def broker_roles(desired: DesiredState) -> list[BrokerRole]:
    """The roles of the module docstring for `desired`'s lanes, reader and dispatcher first."""
    roles = [
        BrokerRole(
            READER,
            "passes, fabric status, fabric lane status: lane state, read only",
            _privileges(**{table: "SELECT" for table in TABLES}),
        ),
        BrokerRole(
            DISPATCHER,
            "leader candidates: dispatch, enqueue, settle (the fabric's tables, saq's jobs)",
            _privileges(
                saq_jobs="SELECT INSERT UPDATE DELETE",
                saq_jobs_lock_key_seq="USAGE SELECT",
                saq_stats="SELECT",
                saq_versions="SELECT",
                fabric_lane_jobs="SELECT INSERT UPDATE DELETE",
                fabric_lane_jobs_seq_seq="USAGE SELECT",
                fabric_lane_fence="SELECT UPDATE",
            ),
        ),
    ]
    for lane in desired.lanes:
        queues = {q for q in (lane_queue_name(desired.fleet, lane), agent_queue_name(desired.fleet, lane)) if q is not None}
        if not queues:
            continue
        roles.append(
            BrokerRole(
                agent_role(lane.id),
                f"the workers of lane {lane.id}: take and finish jobs on {', '.join(sorted(queues))}, beat there",
                _privileges(saq_jobs="SELECT UPDATE DELETE", saq_stats="SELECT INSERT UPDATE DELETE"),
                queues=tuple(sorted(queues)),
            )
        )
    return roles


@dataclass(frozen=True, order=True)
class Policy:
    """A row-level security policy of one role on one table: the rows whose
    `column` is one of `queues` (None: every row)."""

    table: str
    role: str
    column: str
    queues: tuple[str, ...] | None

    @property
    def definition(self) -> str:
        """What the policy allows, as init-roles stores it beside the policy
        (its comment): a policy whose comment differs is made again."""
        rows = "every row" if self.queues is None else f"{self.column} in {', '.join(self.queues)}"
        return f"fabric: {self.role} on {self.table}: {rows}"


def wanted_policies(roles: list[BrokerRole]) -> list[Policy]:
    out = []
    for role in roles:
        for table, column in ROW_SECURED.items():
            if table not in role.privileges:
                continue
            queues = None
            if role.queues is not None:
                # Its set-aside runs too (module docstring), on saq_jobs only.
                queues = tuple(sorted({*role.queues, SUPERSEDED_QUEUE})) if table == SAQ_JOBS else role.queues
            out.append(Policy(table, role.name, column, queues))
    return sorted(out)


def search_path_of(role: str) -> str:
    """An agent's search_path: its own schema first (saq's `CREATE TABLE IF
    NOT EXISTS` lands there and finds the view), then public."""
    return f'"{role}", public'


@dataclass(frozen=True)
class BrokerState:
    """What the broker holds now, as init-roles reads it (fabric-* roles only)."""

    roles: frozenset[str] = frozenset()
    # (role, table or sequence, privilege) held.
    privileges: frozenset[tuple[str, str, str]] = frozenset()
    row_security: frozenset[str] = frozenset()
    # (table, policy name) -> its comment (None: none).
    policies: Mapping[tuple[str, str], str | None] = field(default_factory=dict)
    # Agents whose own schema holds saq's version view they may read and create in.
    schemas: frozenset[str] = frozenset()
    # role -> its search_path in this database (as PostgreSQL stores it; None: not set).
    search_paths: Mapping[str, str | None] = field(default_factory=dict)


StepKind = Literal["create_role", "grant", "revoke", "row_security", "policy", "drop_policy", "schema", "search_path"]


@dataclass(frozen=True)
class RoleStep:
    kind: StepKind
    role: str | None = None
    table: str | None = None
    privilege: str | None = None
    policy: Policy | None = None

    def describe(self) -> str:
        if self.kind == "create_role":
            return f"created role {self.role} (LOGIN, no password)"
        if self.kind == "grant":
            return f"granted {self.privilege} on {self.table} to {self.role}"
        if self.kind == "revoke":
            return f"revoked {self.privilege} on {self.table} from {self.role}"
        if self.kind == "row_security":
            return f"enabled row-level security on {self.table}"
        if self.kind == "policy":
            assert self.policy is not None
            return f"made policy {self.policy.role} on {self.policy.table}: {self.policy.definition.split(': ', 2)[2]}"
        if self.kind == "drop_policy":
            return f"dropped policy {self.role} on {self.table} (not wanted)"
        if self.kind == "schema":
            return f"made schema {self.role} (saq's version view; the role may create only there)"
        return f"set {self.role}'s search_path to {search_path_of(self.role or '')}"


def _same_search_path(stored: str | None, role: str) -> bool:
    return stored is not None and stored.replace(" ", "") == search_path_of(role).replace(" ", "")


def role_steps(want: list[BrokerRole], have: BrokerState) -> list[RoleStep]:
    """The changes that take `have` to `want` (module docstring), in an order
    that works: roles, schemas, grants, revokes, row security, policies."""
    steps = [RoleStep("create_role", role=r.name) for r in want if r.name not in have.roles]
    for r in want:
        if r.own_schema:
            if r.name not in have.schemas:
                steps.append(RoleStep("schema", role=r.name))
            if not _same_search_path(have.search_paths.get(r.name), r.name):
                steps.append(RoleStep("search_path", role=r.name))
    wanted = {(r.name, obj, p) for r in want for obj, privileges in r.privileges.items() for p in privileges}
    steps += [RoleStep("grant", role=role, table=obj, privilege=p) for role, obj, p in sorted(wanted - have.privileges)]
    steps += [
        RoleStep("revoke", role=role, table=obj, privilege=p) for role, obj, p in sorted(have.privileges - wanted) if role.startswith(MANAGED_PREFIX)
    ]
    steps += [RoleStep("row_security", table=table) for table in ROW_SECURED if table not in have.row_security]
    policies = wanted_policies(want)
    for policy in policies:
        if have.policies.get((policy.table, policy.role), None) != policy.definition:
            steps.append(RoleStep("policy", role=policy.role, table=policy.table, policy=policy))
    named = {(p.table, p.role) for p in policies}
    steps += [
        RoleStep("drop_policy", role=name, table=table)
        for table, name in sorted(have.policies)
        if name.startswith(MANAGED_PREFIX) and (table, name) not in named
    ]
    return steps
