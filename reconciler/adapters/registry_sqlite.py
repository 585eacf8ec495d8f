"""The embedded registry: one sqlite file, safe for several processes at once.

WAL journal, and every write is a `BEGIN IMMEDIATE` transaction with a busy
timeout, so concurrent reconcile passes, the leader loop and CLI commands
serialize their writes instead of failing. sqlite has no TTLs: a heartbeat,
the leader's term and a timed slot claim store their deadline (injected clock,
seconds since the epoch), and readers compare it with the clock. Expired rows
are ignored by readers and deleted by the next writer that meets them.

Every sqlite failure (file cannot be opened, stays locked past the busy
timeout, disk errors) surfaces as `RegistryUnavailable`.

Trust: whoever can write the file can write the whole live state (the plan,
the leader, every host's facts). The file is created root-only (0600; a
directory created here 0700), and a file (or its -wal/-shm companion) that
group or others may write, or that another non-root user owns, is refused
with `RegistryUnavailable` saying why: the pass fails static, other commands
exit 1. So is a directory that group or others may write without the sticky
bit (anyone could put another file in its place).
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from reconciler.adapters.registry_common import LifecycleMixin, LiveRead
from reconciler.adapters.registry_records import (
    MAX_PLAN_BYTES,
    WHAT,
    glance_of,
    member_records,
    parse_int,
    parse_record,
    plan_read_of,
    read_index,
    read_plan,
    renewed_report,
    require,
    stored_plan,
    validation_reason,
)
from reconciler.adapters.registry_sqlite_file import CHANGES, EPOCH, TERM, SqliteFile
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.members import MemberRecord
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.pending import PendingRecord
from reconciler.core.live.plan_parts import PartsMemo, PlanIndex, PlanRead
from reconciler.core.live.records import (
    DrainRequest,
    LeaderInfo,
    Leadership,
    NodeRecord,
    ScalingRecord,
    check_node_id,
)
from reconciler.core.live.unreadable import UnreadableRecord
from reconciler.core.live.watching import DRAIN, PLAN, STATE, EntryVersion
from reconciler.core.scheduling.lifecycle import NodeState, alive_at, heartbeat_timeout, stored_state, with_facts
from reconciler.core.scheduling.suspicion import LivenessRecord
from reconciler.core.timestamps import from_epoch_seconds
from reconciler.ports import Clock, NotLeader, RegistryError

Parsed = TypeVar("Parsed", bound=BaseModel)

# Polls of wait_for_change.
POLL_S = 0.1

Row = tuple[Any, ...]


@dataclass(frozen=True)
class _Rows:
    """The rows of one read, as sqlite gave them (any column may hold any type)."""

    nodes: list[Row]
    states: list[Row]
    drains: list[Row]
    plan: Row | None
    # The plan's parts by digest (empty without an index).
    parts: dict[str, Any]
    leader: Row | None
    epoch: Row | None
    scaling: Row | None


def _by_node(rows: list[Row], table: str, model: type[Parsed], problems: list[UnreadableRecord]) -> dict[str, Parsed]:
    """Each row's record parsed on its own; one that does not parse, or that
    names another node than its row's, is skipped and named in `problems`."""
    out: dict[str, Parsed] = {}
    for node_id, raw in rows:
        node = str(node_id)
        key = f"{table}/{node}"
        parsed, problem = parse_record(model, raw, key=key, node=node)
        named = getattr(parsed, "node_id", node)
        if parsed is not None and named != node:
            parsed, problem = None, UnreadableRecord(key=key, node=node, what=WHAT[table], reason=f"names another host ({named})")
        if parsed is not None:
            out[node] = parsed
        elif problem is not None:
            problems.append(problem)
    return out


def _plan_rows(db: sqlite3.Connection) -> tuple[Row | None, dict[str, Any]]:
    """The plan's index row and its parts by digest, in the caller's transaction."""
    index = db.execute("SELECT plan_index FROM plan_index WHERE id = 1").fetchone()
    if index is None:
        return None, {}
    return index, {str(digest): part for digest, part in db.execute("SELECT digest, part FROM plan_parts")}


def _parse_read(rows: _Rows, now: float) -> LiveRead:
    """One read's rows, each parsed on its own: one that does not parse or
    validate is skipped and named (`LiveRead.problems`); its node then counts
    as not beating."""
    moment = from_epoch_seconds(now)
    problems: list[UnreadableRecord] = []
    records = _by_node(rows.nodes, "nodes", NodeRecord, problems)
    stored = _by_node(rows.states, "node_states", NodeState, problems)
    drains = _by_node(rows.drains, "drains", DrainRequest, problems)
    plan = leader = scaling = None
    if rows.plan is not None:
        plan, problem = read_plan(rows.plan[0], rows.parts.get, where="sqlite plan_index")
        problems += [problem] if problem else []
    if rows.leader is not None and isinstance(rows.leader[1], int | float) and rows.leader[1] > now:
        leader, problem = parse_record(LeaderInfo, rows.leader[0], key="leader")
        problems += [problem] if problem else []
    if rows.scaling is not None:
        scaling, problem = parse_record(ScalingRecord, rows.scaling[0], key="scaling", limit=MAX_PLAN_BYTES)
        problems += [problem] if problem else []
    epoch = 0
    if rows.epoch is not None:
        counter, problem = parse_int(str(rows.epoch[0]), key="epoch")
        epoch = counter or 0
        problems += [problem] if problem else []
    # A state is stored without what the node's record holds
    # (`stored_state`), so a beat alone rewrites no state.
    states = {node_id: with_facts(state, records.get(node_id)) for node_id, state in stored.items()}
    return LiveRead(
        now=moment,
        records=records,
        alive=frozenset(alive_at(records, moment)),
        states=states,
        drains=drains,
        plan=plan,
        leader=leader,
        epoch=epoch,
        concurrency=dict(scaling.concurrency) if scaling is not None else {},
        problems=tuple(problems),
    )


class SqliteRegistry(SqliteFile, LifecycleMixin):
    def __init__(
        self,
        path: str | Path,
        *,
        timing: TimingSettings,
        flap: FlapSettings,
        clock: Clock,
        busy_timeout_s: float = 10.0,
        opened: SqliteFile | None = None,
    ) -> None:
        self.timing = timing
        self.flap = flap
        # wait_for_change: the change counter and the next expiry it last saw.
        self._seen_changes: int | None = None
        # The parts' bytes and digests of the plans published before (plan_parts.PartsMemo).
        self._parts_memo = PartsMemo()
        self._next_expiry: float | None = None
        # watch_host: the host whose baseline was reported (None: none yet).
        self._watched_host: str | None = None
        super().__init__(path, clock=clock, busy_timeout_s=busy_timeout_s, opened=opened)

    # -- nodes ------------------------------------------------------------------

    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        ttl = float(ttl_s if ttl_s is not None else heartbeat_timeout(self.timing, record.relayed))
        return NodeRecord.model_validate(self.heartbeat_json(record.model_dump(mode="json"), ttl))

    # -- fast liveness (issue 30) ------------------------------------------------

    def keep_alive(self, host: str, ttl_s: float) -> LivenessRecord:
        check_node_id(host)
        now = self._now()
        with self._tx() as db:
            db.execute(
                "INSERT INTO liveness (host, expires_at, ttl_s) VALUES (?, ?, ?) "
                "ON CONFLICT(host) DO UPDATE SET expires_at = excluded.expires_at, ttl_s = excluded.ttl_s",
                (host, now + ttl_s, ttl_s),
            )
        return LivenessRecord(host=host, expires_at=from_epoch_seconds(now + ttl_s), ttl_s=ttl_s)

    def liveness(self) -> list[LivenessRecord]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT host, expires_at, ttl_s FROM liveness ORDER BY host").fetchall()
        out = []
        for host, expires_at, ttl_s in rows:
            try:
                out.append(LivenessRecord(host=check_node_id(str(host)), expires_at=from_epoch_seconds(float(expires_at)), ttl_s=float(ttl_s)))
            except (TypeError, ValueError):
                continue  # never trusted: a bad row is no liveness
        return out

    def report_edge_upstreams(self, edge: str, record: bytes) -> None:
        check_node_id(edge)
        with self._tx() as db:
            db.execute(
                "INSERT INTO edge_upstreams (edge, record) VALUES (?, ?) ON CONFLICT(edge) DO UPDATE SET record = excluded.record",
                (edge, bytes(record)),
            )

    def edge_upstreams(self) -> dict[str, bytes]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT edge, record FROM edge_upstreams ORDER BY edge").fetchall()
        return {str(edge): record if isinstance(record, bytes) else str(record).encode() for edge, record in rows}

    def set_drain(self, node_id: str, grace_s: float = 0, reason: str = "operator drain") -> DrainRequest:
        request = DrainRequest(node_id=check_node_id(node_id), requested_at=from_epoch_seconds(self._now()), grace_s=grace_s, reason=reason)
        with self._tx() as db:
            db.execute(
                "INSERT INTO drains (node_id, request) VALUES (?, ?) ON CONFLICT(node_id) DO UPDATE SET request = excluded.request",
                (node_id, request.model_dump_json()),
            )
            self._bump(db, CHANGES)
        return request

    def clear_drain(self, node_id: str) -> bool:
        with self._tx() as db:
            gone = db.execute("DELETE FROM drains WHERE node_id = ?", (node_id,)).rowcount
            if gone:
                self._bump(db, CHANGES)
        return bool(gone)

    # -- pending machines (no authority: never part of the snapshot) -------------------

    def report_pending(self, record: PendingRecord, ttl_s: float) -> PendingRecord:
        now = self._now()
        node_id = check_node_id(record.node_id)
        with self._tx() as db:
            db.execute("DELETE FROM pending WHERE expires_at <= ?", (now,))
            row = db.execute("SELECT record FROM pending WHERE node_id = ?", (node_id,)).fetchone()
            stored, value = renewed_report(
                record,
                row[0] if row else None,
                key=f"pending/{node_id}",
                node=node_id,
                now=from_epoch_seconds(now),
                ttl_s=ttl_s,
                what=f"pending report of {node_id}",
            )
            db.execute(
                "INSERT INTO pending (node_id, record, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET record = excluded.record, expires_at = excluded.expires_at",
                (node_id, value.decode(), now + ttl_s),
            )
        return stored

    def pending_nodes(self) -> tuple[list[PendingRecord], list[str]]:
        now = self._now()
        with self._tx(write=False) as db:
            rows = db.execute("SELECT node_id, record FROM pending WHERE expires_at > ?", (now,)).fetchall()
        problems: list[UnreadableRecord] = []
        records = _by_node(rows, "pending", PendingRecord, problems)
        return [records[k] for k in sorted(records)], [p.line() for p in problems]

    # -- group members (admitted by the leader, never by this table) -----------------

    def report_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        now = self._now()
        node_id, group = check_node_id(record.node_id), check_node_id(record.group)
        with self._tx() as db:
            db.execute("DELETE FROM members WHERE expires_at <= ?", (now,))
            row = db.execute("SELECT record FROM members WHERE group_name = ? AND node_id = ?", (group, node_id)).fetchone()
            stored, value = renewed_report(
                record,
                row[0] if row else None,
                key=f"members/{group}/{node_id}",
                node=node_id,
                now=from_epoch_seconds(now),
                ttl_s=ttl_s,
                what=f"member report of {node_id}",
            )
            joined = row is None
            db.execute(
                "INSERT INTO members (group_name, node_id, record, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(group_name, node_id) DO UPDATE SET record = excluded.record, expires_at = excluded.expires_at",
                (group, node_id, value.decode(), now + ttl_s),
            )
            if joined:
                self._bump(db, CHANGES)  # a member joined: the leader looks again
        return stored

    def group_members(self) -> tuple[list[MemberRecord], list[str]]:
        now = self._now()
        with self._tx(write=False) as db:
            rows = db.execute("SELECT group_name, node_id, record FROM members WHERE expires_at > ? ORDER BY group_name, node_id", (now,)).fetchall()
        return member_records([(f"{group}/{node}", raw) for group, node, raw in rows])

    # -- leadership -----------------------------------------------------------------

    def _current_leader(self, db: sqlite3.Connection, now: float) -> tuple[LeaderInfo, str] | None:
        row = db.execute("SELECT info, token, expires_at FROM leader WHERE id = 1").fetchone()
        if row is None or row[2] <= now:
            return None
        return LeaderInfo.model_validate_json(row[0]), row[1]

    def leader_term(self) -> LeaderInfo | None:
        """The leader row, live, lapsed or resigned (a resignation keeps it:
        its term stays current until the next campaign). The term is the
        TERM counter the campaign's transaction raised."""
        with self._tx(write=False) as db:
            row = db.execute("SELECT info FROM leader WHERE id = 1").fetchone()
        if row is None:
            return None
        try:
            return LeaderInfo.model_validate_json(row[0])
        except ValueError:  # pydantic's ValidationError is a ValueError
            return None

    def _require_leader(self, db: sqlite3.Connection, leadership: Leadership, now: float) -> None:
        current = self._current_leader(db, now)
        if current is None or current[1] != leadership.info.token:
            who = f"{current[0].candidate} leads" if current else "nobody leads"
            raise NotLeader(f"{leadership.candidate}'s term of epoch {leadership.epoch} is over ({who})")

    def campaign(self, candidate: str, ttl_s: float) -> Leadership | None:
        now = self._now()
        with self._tx() as db:
            if self._current_leader(db, now) is not None:
                return None
            return self._claim(db, candidate, ttl_s, now)

    def take_over(self, candidate: str, ttl_s: float, held: LeaderInfo) -> Leadership | None:
        """In one transaction: the leader row is still `held` (its token and
        renewal) and its host's liveness row has lapsed (its deadline
        passed; no row: no lapse); then the campaign's write of a new term,
        whose token the old term's writes no longer match."""
        now = self._now()
        with self._tx() as db:
            row = db.execute("SELECT info, token FROM leader WHERE id = 1").fetchone()
            if row is None or row[1] != held.token:
                return None
            info, _ = parse_record(LeaderInfo, row[0], key="leader")
            if info is None or info.renewed_at != held.renewed_at:
                return None
            live = db.execute("SELECT expires_at FROM liveness WHERE host = ?", (held.candidate,)).fetchone()
            if live is None or not isinstance(live[0], int | float) or live[0] > now:
                return None
            return self._claim(db, candidate, ttl_s, now)

    def _claim(self, db: sqlite3.Connection, candidate: str, ttl_s: float, now: float) -> Leadership:
        """A new term for `candidate` in the caller's transaction: the epoch
        and the term counter raised, the leader row written."""
        epoch = self._bump(db, EPOCH)
        moment = from_epoch_seconds(now)
        info = LeaderInfo(
            candidate=candidate,
            epoch=epoch,
            since=moment,
            token=secrets.token_hex(16),
            term=self._bump(db, TERM),
            renewed_at=moment,
            ttl_s=ttl_s,
        )
        db.execute(
            "INSERT INTO leader (id, info, token, expires_at) VALUES (1, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET info = excluded.info, token = excluded.token, expires_at = excluded.expires_at",
            (info.model_dump_json(), info.token, now + ttl_s),
        )
        self._bump(db, CHANGES)
        return Leadership(info=info, ttl_s=ttl_s)

    def renew(self, leadership: Leadership) -> bool:
        now = self._now()
        renewed = leadership.info.model_copy(update={"renewed_at": from_epoch_seconds(now), "ttl_s": leadership.ttl_s})
        with self._tx() as db:
            updated = db.execute(
                "UPDATE leader SET expires_at = ?, info = ? WHERE id = 1 AND token = ? AND expires_at > ?",
                (now + leadership.ttl_s, renewed.model_dump_json(), leadership.info.token, now),
            ).rowcount
        return bool(updated)

    def resign(self, leadership: Leadership) -> None:
        """The row stays, resigned and expired: its term stays the current
        one (hosts keep applying its plan) until the next campaign."""
        resigned = leadership.info.model_copy(update={"resigned": True, "renewed_at": from_epoch_seconds(self._now())})
        with self._tx() as db:
            if db.execute(
                "UPDATE leader SET expires_at = 0, info = ? WHERE id = 1 AND token = ? AND expires_at > 0",
                (resigned.model_dump_json(), leadership.info.token),
            ).rowcount:
                self._bump(db, CHANGES)

    def leader(self) -> LeaderInfo | None:
        try:
            with self._tx(write=False) as db:
                current = self._current_leader(db, self._now())
        except ValidationError as exc:  # never trusted: the port's error, not a parse error
            raise RegistryError(f"sqlite registry {self.path}: unreadable leader record: {validation_reason(exc)}") from None
        return current[0] if current else None

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        """The plan in parts, as etcd stores it (one transaction here): the
        parts not stored yet, the index, and no part the index does not name."""
        with self._tx() as db:
            self._require_leader(db, leadership, self._now())
            epoch = self._bump(db, EPOCH)
            stored = stored_plan(
                plan.model_copy(update={"epoch": epoch, "leader": leadership.candidate, "term": leadership.term}),
                budget=MAX_PLAN_BYTES,
                memo=self._parts_memo,
            )
            have = {str(row[0]) for row in db.execute("SELECT digest FROM plan_parts")}
            db.executemany("INSERT INTO plan_parts (digest, part) VALUES (?, ?)", [(d, v) for d, v in stored.parts.items() if d not in have])
            db.executemany("DELETE FROM plan_parts WHERE digest = ?", [(d,) for d in sorted(have - set(stored.parts))])
            db.execute(
                "INSERT INTO plan_index (id, epoch, plan_index) VALUES (1, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET epoch = excluded.epoch, plan_index = excluded.plan_index",
                (epoch, stored.index_bytes.decode()),
            )
        return stored.plan

    def newest_plan(self) -> FleetPlan | None:
        with self._tx(write=False) as db:
            index, parts = _plan_rows(db)
        if index is None:
            return None
        where = f"sqlite registry {self.path}"
        return require(read_plan(index[0], parts.get, where=where), where)

    def plan_glance(self, host: str) -> tuple[int, dict[str, str]] | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT plan_index FROM plan_index WHERE id = 1").fetchone()
        return None if row is None else glance_of(row[0], host, where=f"sqlite registry {self.path}")

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        """The index, then only the parts `choose` names, by digest, in the same read transaction."""
        where = f"sqlite registry {self.path}"
        with self._tx(write=False) as db:
            row = db.execute("SELECT plan_index FROM plan_index WHERE id = 1").fetchone()
            if row is None:
                return None
            index = read_index(row[0], where=where)
            names = sorted(set(choose(index)))
            digests = [index.parts[name] for name in names if name in index.parts]
            parts = {
                str(d): part
                for d, part in db.execute(f"SELECT digest, part FROM plan_parts WHERE digest IN ({','.join('?' * len(digests))})", digests)
            }
        return plan_read_of(index, names, parts.get, where=where)

    # -- scaling --------------------------------------------------------------------------

    def _scaling(self, db: sqlite3.Connection) -> ScalingRecord:
        row = db.execute("SELECT record FROM scaling WHERE id = 1").fetchone()
        # One that does not parse is skipped like any record (the full read
        # names it): the leader starts a new memory and overwrites it.
        record, _ = parse_record(ScalingRecord, row[0], key="scaling", limit=MAX_PLAN_BYTES) if row is not None else (None, None)
        return record or ScalingRecord()

    def scaling_record(self) -> ScalingRecord:
        with self._tx(write=False) as db:
            return self._scaling(db)

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        with self._tx() as db:
            self._require_leader(db, leadership, self._now())
            db.execute(
                "INSERT INTO scaling (id, record) VALUES (1, ?) ON CONFLICT(id) DO UPDATE SET record = excluded.record",
                (record.model_dump_json(),),
            )

    # -- reading it all, and the leader's lifecycle ----------------------------------

    def _read(self, with_plan: bool = True) -> LiveRead:
        now = self._now()
        with self._tx(write=False) as db:
            index, parts = _plan_rows(db) if with_plan else (None, {})
            rows = _Rows(
                nodes=db.execute("SELECT node_id, record FROM nodes").fetchall(),
                states=db.execute("SELECT node_id, state FROM node_states").fetchall(),
                drains=db.execute("SELECT node_id, request FROM drains").fetchall(),
                plan=index,
                parts=parts,
                leader=db.execute("SELECT info, expires_at FROM leader WHERE id = 1").fetchone(),
                epoch=db.execute("SELECT value FROM meta WHERE key = ?", (EPOCH,)).fetchone(),
                scaling=db.execute("SELECT record FROM scaling WHERE id = 1").fetchone(),
            )
        return _parse_read(rows, now)

    def _store_lifecycle(self, leadership: Leadership, changed: dict[str, NodeState], dead: set[str], forgotten: set[str]) -> None:
        now = self._now()
        with self._tx() as db:
            self._require_leader(db, leadership, now)
            for node_id, state in changed.items():
                db.execute(
                    "INSERT INTO node_states (node_id, state) VALUES (?, ?) ON CONFLICT(node_id) DO UPDATE SET state = excluded.state",
                    (node_id, stored_state(state).model_dump_json()),
                )
            # Only a beat that is still expired is dropped: a node that beat
            # again since the read keeps its fresh record.
            for node_id in dead | forgotten:
                db.execute("DELETE FROM nodes WHERE node_id = ? AND expires_at <= ?", (node_id, now))
            for node_id in forgotten:
                db.execute("DELETE FROM node_states WHERE node_id = ?", (node_id,))
                db.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))

    def _next_deadline(self, db: sqlite3.Connection, now: float) -> float | None:
        row = db.execute(
            "SELECT MIN(e) FROM (SELECT expires_at AS e FROM nodes UNION ALL SELECT expires_at FROM leader) WHERE e > ?",
            (now,),
        ).fetchone()
        return row[0] if row and row[0] is not None else None

    def wait_for_change(self, timeout_s: float) -> bool:
        """Polls the change counter, and wakes when the next deadline of a live
        heartbeat or of the leader's term passes (an expiry writes nothing).
        The first call arms it; a change made between two calls is reported
        by the second at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self._now()
            with self._tx(write=False) as db:
                changes = self._meta(db, CHANGES)
                changed = (self._seen_changes is not None and changes != self._seen_changes) or (
                    self._next_expiry is not None and now >= self._next_expiry
                )
                if changed or self._seen_changes is None:
                    self._seen_changes = changes
                    self._next_expiry = self._next_deadline(db, now)
            if changed:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(POLL_S, remaining))

    # -- fabric watch ---------------------------------------------------------------

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        """A cheap poll: three primary-key reads in one read transaction, after
        waiting `timeout_s` (at once the first time, for the baseline). The
        plan's version is its epoch; a drain request's or node state's, its
        stored JSON (it holds the request time, the state's transitions)."""
        check_node_id(host)
        if self._watched_host == host:
            time.sleep(timeout_s)
        with self._tx(write=False) as db:
            plan = db.execute("SELECT epoch FROM plan_index WHERE id = 1").fetchone()
            drain = db.execute("SELECT request FROM drains WHERE node_id = ?", (host,)).fetchone()
            state = db.execute("SELECT state FROM node_states WHERE node_id = ?", (host,)).fetchone()
        self._watched_host = host
        return [
            EntryVersion(PLAN, "", str(plan[0]) if plan else ""),
            EntryVersion(DRAIN, host, drain[0] if drain else ""),
            EntryVersion(STATE, host, state[0] if state else ""),
        ]
