"""The lane queue on phaze's broker: SAQ 0.26 on PostgreSQL, through psycopg 3.

Tables, all in the broker's database:
    saq_jobs, saq_stats   SAQ's own (created by saq's migrations, see below):
                          each lane's jobs, rows whose `queue` is the lane's
                          queue, and each worker's heartbeat (its stats row,
                          alive until `expire_at`)
    fabric_lane_jobs      the jobs the job system handed the fabric: id,
                          enqueue time, attempts, duration; while dispatched,
                          the lane, its queue and the SAQ job's key
    fabric_lane_fence     one row: the dispatch lock, and the term that
                          dispatched last (its `epoch` column: a record for
                          people, never what decides)

Dispatch (`dispatch`) is one transaction:
    fence                 the fence row locked FOR UPDATE (one dispatch at a
                          time, so the count below cannot go stale before the
                          insert; a lock only the dispatcher role can take:
                          an advisory lock any broker client could hold),
                          then the registry's current term read
                          (`DispatchFence.current_term`): any other term than
                          the dispatcher's is refused (StaleDispatcher). A
                          number written into the row stops nothing; a new
                          term's first dispatch waits for the old term's
                          open one to commit. Lock waits are bounded
                          (lock_timeout), so a client holding the row delays
                          dispatch, never hangs it
    the job               still waiting (SELECT ... FOR UPDATE)
    the slot count        the queue's saq_jobs rows that are not finished
                          (new, deferred, queued, active) < cap
    the SAQ job           inserted exactly as saq's PostgresQueue.enqueue
                          writes it (its own serializer), NOTIFY on the
                          queue's channel so an idle worker wakes at once

The SAQ job has no timeout (a file takes as long as it takes), one try (a
failure comes back here: the fabric counts the cloud attempt and the lane
rules choose again), the heartbeat the fleet asks for (none by default) and
ttl 0 (saq keeps the finished row): `settle` reads how it ended and deletes
it. Its key is `<job id>.<n>`, n counting the job's dispatches: each run of
a job has a key of its own, so nothing written for one run can end another.

A worker that dies mid-job leaves an active row for ever (saq sweeps only a
job past its timeout or heartbeat, and only a worker of the same queue
sweeps). The dispatcher settles it (`settle_crashed`): `active_runs` reads,
in one transaction, each active run of the fabric's jobs with the worker
that began it (the job's `worker_id`) and that worker's stats expiry, and
the broker's clock and start time; core.scheduling.lanes decides which
crashed; `settle_crashed`, fenced like `dispatch`, sets each one aside
(status aborting, moved to SUPERSEDED_QUEUE, which no worker consumes) and
puts its job back to wait. Set aside, the run frees its slot and nothing
dequeues it again (not even a retry saq makes of it); a worker that lives
after all still finds it by key: its abort check sees `aborting` and
cancels it, or its late finish lands on the set-aside row, and
`sweep_superseded` reports that finish (ignored) and clears the row.

The DSN never leaves this module: it is read from the file the desired state
names (`[phaze] queue_url_file`, the reader's; `dispatcher_url_file`, the
dispatcher's) by reconciler.wiring and handed in. With `fabric lane
init-roles` (reconciler.adapters.lane_broker_roles) each is a role's that
may do only what its component needs: the reader makes and writes nothing,
so the tables are made by init-roles (`make_tables`) with the owner's DSN.

What a pass does with the broker is read: each lane's in_flight and workers
(`lane_states`; a memoized pass only the in_flight, `in_flight`), plain SQL
on saq's two tables. That, and opening the queue (one session), imports
neither saq (nor croniter and dateutil, which saq's worker imports) nor
psycopg's pool nor a model: saq's migrations and the fabric's own tables are
made before the first dispatch, enqueue, jobs or settle (`_prepare`), and
before a read that finds saq's tables missing (a broker nobody used yet),
which is then made again.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from reconciler.core.timestamps import from_epoch_seconds
from reconciler.ports import Clock, DispatchFence, LaneBrokerError, LaneBrokerUnavailable, LaneTarget, StaleDispatcher

if TYPE_CHECKING:
    from saq.queue.postgres import PostgresQueue

    from reconciler.core.live.models import PhazeAgentSeen, SnapshotLane
    from reconciler.core.live.records import QueuedJob, SettledJob
    from reconciler.core.scheduling.lanes import ActiveRun, BrokerRuns, CrashedRun

T = TypeVar("T")

# saq 0.26's tables (saq.queue.postgres JOBS_TABLE and STATS_TABLE; the
# integration tests check they agree), spelled here so that reading the lanes
# imports no saq.
JOBS_TABLE = "saq_jobs"
STATS_TABLE = "saq_stats"
# saq_jobs statuses that hold a lane slot: everything not finished.
UNFINISHED = ("new", "deferred", "queued", "active")
# Where a run settled as crashed (or found aborting) is set aside: a queue no
# worker consumes (see the module docstring) ...
SUPERSEDED_QUEUE = "fabric-superseded"
# ... kept this long when nobody finishes it (its worker is gone for good).
SUPERSEDED_KEEP_S = 86_400

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fabric_lane_jobs (
    job_id TEXT PRIMARY KEY,
    seq BIGSERIAL,
    enqueued_at DOUBLE PRECISION NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    duration_s DOUBLE PRECISION,
    lane TEXT,
    queue TEXT,
    saq_key TEXT,
    cloud BOOLEAN NOT NULL DEFAULT FALSE,
    dispatched_at DOUBLE PRECISION,
    dispatches INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS fabric_lane_fence (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    epoch BIGINT NOT NULL
);
INSERT INTO fabric_lane_fence (id, epoch) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
"""


FABRIC_TABLES = ("fabric_lane_jobs", "fabric_lane_fence")


def _fabric_tables_made(conn: psycopg.Connection[Any]) -> bool:
    """The fabric's tables and the fence's row are there (read with the
    catalog, which any role may, and the fence, which every role of
    init-roles that dispatches may read)."""
    made = conn.execute("SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest(%s::text[]) AS t", (list(FABRIC_TABLES),)).fetchone()
    if made is None or not made[0]:
        return False
    try:
        with conn.transaction():
            return conn.execute("SELECT 1 FROM fabric_lane_fence WHERE id = 1").fetchone() is not None
    except psycopg.errors.InsufficientPrivilege:
        return True  # not this role's to read (nor to make)


def make_tables(dsn: str, timeout_s: float = 5.0) -> list[str]:
    """saq's tables (its migrations) and the fabric's, made where missing, with
    the broker's owner's DSN (`fabric lane init-roles`); what was made, said."""
    made = []
    with psycopg.connect(dsn, autocommit=True, **_bounded(timeout_s)) as conn:
        saq_before = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (JOBS_TABLE,)).fetchone()
    _saq_tables(dsn, timeout_s)
    if saq_before is not None and not saq_before[0]:
        made.append(f"made saq's tables ({JOBS_TABLE}, {STATS_TABLE}) with saq's migrations")
    with psycopg.connect(dsn, autocommit=True, **_bounded(timeout_s)) as conn, conn.transaction():
        if not _fabric_tables_made(conn):
            conn.execute(_SCHEMA)
            made.append(f"made the fabric's tables ({', '.join(FABRIC_TABLES)})")
    return made


def _saq_tables(dsn: str, timeout_s: float) -> None:
    """Create (or migrate) saq's tables with saq's own migrations, only when
    the database is not at saq's version yet (read on a plain connection, so
    a pass at a migrated broker opens no pool). Every wait is bounded by
    `timeout_s`: a broker that does not answer must never hold a pass (it
    holds the host's pass lock); the pool is closed whatever happens, so no
    reconnecting task outlives the call. Raises psycopg.Error, PoolTimeout or
    TimeoutError."""
    import asyncio

    from psycopg_pool import AsyncConnectionPool
    from saq.queue.postgres import VERSIONS_TABLE, PostgresQueue
    from saq.queue.postgres_migrations import get_migrations

    target = get_migrations(jobs_table=sql.Identifier(JOBS_TABLE), stats_table=sql.Identifier(STATS_TABLE))[-1][0]
    with psycopg.connect(dsn, autocommit=True, **_bounded(timeout_s)) as conn:
        try:
            row = conn.execute(sql.SQL("SELECT version FROM {}").format(sql.Identifier(VERSIONS_TABLE))).fetchone()
        except psycopg.errors.UndefinedTable:
            row = None
    if row is not None and row[0] == target:
        return

    async def migrate() -> None:
        pool = AsyncConnectionPool(
            dsn,
            open=False,
            min_size=1,
            max_size=1,
            timeout=timeout_s,
            reconnect_timeout=timeout_s,
            kwargs={"autocommit": True, **_bounded(timeout_s)},
        )
        try:
            await pool.open(wait=True, timeout=timeout_s)
            await asyncio.wait_for(PostgresQueue(pool=pool, name="fabric-init").init_db(), timeout_s)
        finally:
            await pool.close(timeout=timeout_s)

    asyncio.run(migrate())


def _bounded(timeout_s: float) -> dict[str, int]:
    """libpq's bounds on a connection's waits for the broker.

    connect_timeout: whole seconds, at least 1 (0 would mean none).
    tcp_user_timeout (ms): data sent on an open connection that the broker
    does not acknowledge for that long closes it. Without it a broker whose
    network path vanished holds a query for the kernel's retransmissions
    (some 15 minutes): the leader's long-lived connection hung on one in an
    e2e run, its step with it, and a lost node went offline 30 s late."""
    return {"connect_timeout": max(1, int(timeout_s)), "tcp_user_timeout": max(1, int(timeout_s * 1000))}


class PostgresLaneBroker:
    """`reconciler.ports.LaneBroker` on one PostgreSQL database (see the module docstring)."""

    def __init__(self, dsn: str, clock: Clock, *, job_function: str = "process_file", connect_timeout_s: float = 5.0) -> None:
        self._dsn = dsn
        # Never in a message (`_first_line`).
        self._secrets = dsn_secrets(dsn)
        problem = dsn_problem(dsn)
        if problem is not None:
            raise LaneBrokerUnavailable(problem)
        self._clock = clock
        self._function = job_function
        self._timeout = connect_timeout_s
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        # One unconnected saq queue per lane queue: only its serializer is used.
        self._serializers: dict[str, PostgresQueue] = {}
        # saq's tables and the fabric's made (`_prepare`).
        self._prepared = False
        with self._connection():
            pass  # a broker that does not answer: LaneBrokerUnavailable now, as the callers expect of opening

    def _prepare(self) -> None:
        """saq's tables (its migrations, when the database is not at saq's
        version) and the fabric's own, once: before the first use that writes
        or reads the fabric's tables, or a read that found saq's missing."""
        if self._prepared:
            return
        from psycopg_pool import PoolTimeout

        try:
            _saq_tables(self._dsn, self._timeout)
        except (psycopg.OperationalError, OSError, PoolTimeout, TimeoutError) as exc:
            raise LaneBrokerUnavailable(f"phaze's broker: {_first_line(exc, self._secrets)}") from None
        except psycopg.Error as exc:
            raise LaneBrokerError(f"phaze's broker refused: {_first_line(exc, self._secrets)}") from None
        with self._connection() as conn, conn.transaction():
            # A role of `fabric lane init-roles` may not create tables: the
            # schema is run only where the fabric's tables are missing.
            if not _fabric_tables_made(conn):
                conn.execute(_SCHEMA)
        self._prepared = True

    def _reading(self, read: Callable[[psycopg.Connection[Any]], T]) -> T:
        """`read` on the session; when saq's tables are not there (or not as
        saq 0.26 makes them), made first, then `read` again."""
        try:
            with self._connection() as conn:
                return read(conn)
        except _NotMadeYet:
            self._prepared = False
            self._prepare()
            with self._connection() as conn:
                return read(conn)

    # -- plumbing ------------------------------------------------------------
    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock, broker_session(self) as conn:
            yield conn

    def _drop(self) -> None:
        self._conn = dropped(self._conn)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _serializer(self, queue: str) -> PostgresQueue:
        from saq.queue.postgres import PostgresQueue

        if queue not in self._serializers:
            self._serializers[queue] = PostgresQueue.from_url(self._dsn, name=queue, min_size=1, max_size=1)
        return self._serializers[queue]

    # -- the port ------------------------------------------------------------
    def enqueue(self, jobs: Sequence[tuple[str, float | None]]) -> list[QueuedJob]:
        self._prepare()
        now = self._clock.now()
        with self._connection() as conn, conn.transaction():
            for job_id, duration in jobs:
                conn.execute(
                    "INSERT INTO fabric_lane_jobs (job_id, enqueued_at, duration_s) VALUES (%s, %s, %s) ON CONFLICT (job_id) DO NOTHING",
                    (job_id, now, duration),
                )
            rows = conn.execute(f"SELECT {_JOB_COLUMNS} FROM fabric_lane_jobs WHERE job_id = ANY(%s)", ([j for j, _ in jobs],)).fetchall()
        stored = {row[0]: _job(row) for row in rows}
        return [stored[job_id] for job_id, _ in dict.fromkeys(jobs) if job_id in stored]

    def jobs(self) -> list[QueuedJob]:
        self._prepare()
        with self._connection() as conn:
            rows = conn.execute(f"SELECT {_JOB_COLUMNS} FROM fabric_lane_jobs ORDER BY enqueued_at, seq").fetchall()
        return [_job(row) for row in rows]

    def dispatch(self, job_id: str, target: LaneTarget, fence: DispatchFence) -> QueuedJob | None:
        self._prepare()
        now = self._clock.now()
        with self._connection() as conn, conn.transaction():
            _fence(conn, fence, self._timeout)
            row = conn.execute("SELECT dispatches FROM fabric_lane_jobs WHERE job_id = %s AND lane IS NULL FOR UPDATE", (job_id,)).fetchone()
            if row is None:
                return None
            held = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE queue = %s AND status = ANY(%s)").format(sql.Identifier(JOBS_TABLE)),
                (target.queue, list(UNFINISHED)),
            ).fetchone()
            if held is not None and int(held[0]) >= target.cap:
                return None
            key = f"{job_id}.{int(row[0]) + 1}"
            self._put_saq_job(conn, target.queue, key, job_id, target.lane, heartbeat_s=target.heartbeat_s)
            stored = conn.execute(
                "UPDATE fabric_lane_jobs SET lane = %s, queue = %s, saq_key = %s, cloud = %s, dispatched_at = %s, dispatches = dispatches + 1"
                f" WHERE job_id = %s RETURNING {_JOB_COLUMNS}",
                (target.lane, target.queue, key, target.cloud, now, job_id),
            ).fetchone()
        return _job(stored) if stored is not None else None

    def _put_saq_job(self, conn: psycopg.Connection[Any], queue: str, key: str, job_id: str, lane: str, *, heartbeat_s: int = 0) -> None:
        """The row saq's PostgresQueue._enqueue writes, in this transaction."""
        from saq import Job
        from saq.job import Status
        from saq.queue.postgres import CHANNEL, ENQUEUE

        saq_queue = self._serializer(queue)
        job = Job(
            function=self._function,
            kwargs={"job_id": job_id, "lane": lane},
            queue=saq_queue,
            key=key,
            timeout=0,
            heartbeat=heartbeat_s,
            retries=1,
            ttl=0,
        )
        job.status = Status.QUEUED
        job.queued = int(self._clock.now() * 1000)
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (key, job, queue, status, priority, group_key, scheduled)"
                " VALUES (%s, %s, %s, %s, %s, %s, EXTRACT(EPOCH FROM NOW())::BIGINT)"
            ).format(sql.Identifier(JOBS_TABLE)),
            (key, saq_queue.serialize(job), queue, job.status, job.priority, job.group_key),
        )
        conn.execute(sql.SQL("NOTIFY {}, {}").format(sql.Identifier(CHANNEL.format(queue)), sql.Literal(ENQUEUE)))

    def settle(self) -> list[SettledJob]:
        from reconciler.core.live.records import SettledJob

        self._prepare()
        settled = []
        with self._connection() as conn, conn.transaction():
            rows = conn.execute(
                sql.SQL(
                    "SELECT f.job_id, f.lane, f.saq_key, s.status FROM fabric_lane_jobs f"
                    " LEFT JOIN {} s ON s.key = f.saq_key"
                    " WHERE f.lane IS NOT NULL AND (s.key IS NULL OR NOT s.status = ANY(%s))"
                    " FOR UPDATE OF f SKIP LOCKED"
                ).format(sql.Identifier(JOBS_TABLE)),
                (list(UNFINISHED),),
            ).fetchall()
            for job_id, lane, key, status in rows:
                outcome = (
                    "vanished"
                    if status is None
                    else ("complete" if status == "complete" else ("aborted" if status in ("aborted", "aborting") else "failed"))
                )
                if status == "aborting":
                    # saq's sweep is aborting it: its worker may still run it, so it is set aside, not deleted.
                    _set_aside(conn, key)
                else:
                    conn.execute(sql.SQL("DELETE FROM {} WHERE key = %s").format(sql.Identifier(JOBS_TABLE)), (key,))
                if outcome == "complete":
                    gone = conn.execute("DELETE FROM fabric_lane_jobs WHERE job_id = %s RETURNING attempts", (job_id,)).fetchone()
                    attempts = int(gone[0]) if gone else 0
                else:
                    back = conn.execute(
                        "UPDATE fabric_lane_jobs SET lane = NULL, queue = NULL, saq_key = NULL, dispatched_at = NULL,"
                        " attempts = attempts + CASE WHEN cloud THEN 1 ELSE 0 END, cloud = FALSE WHERE job_id = %s RETURNING attempts",
                        (job_id,),
                    ).fetchone()
                    attempts = int(back[0]) if back else 0
                settled.append(SettledJob(job_id=job_id, lane=lane, outcome=outcome, attempts=attempts))
        return settled

    def active_runs(self) -> BrokerRuns:
        from reconciler.core.scheduling.lanes import BrokerRuns

        self._prepare()
        with self._connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            clock = conn.execute("SELECT EXTRACT(EPOCH FROM NOW()), EXTRACT(EPOCH FROM pg_postmaster_start_time())").fetchone()
            assert clock is not None
            rows = conn.execute(
                sql.SQL(
                    "SELECT f.job_id, f.lane, s.key, s.job FROM fabric_lane_jobs f JOIN {} s ON s.key = f.saq_key"
                    " WHERE f.lane IS NOT NULL AND s.status = 'active' ORDER BY f.enqueued_at, f.seq"
                ).format(sql.Identifier(JOBS_TABLE))
            ).fetchall()
            runs = [_active_run(job_id, lane, key, job) for job_id, lane, key, job in rows]
            workers = sorted({run.worker for run in runs if run.worker is not None})
            expiry = {
                worker: float(expire_at)
                for worker, expire_at in conn.execute(
                    sql.SQL("SELECT worker_id, expire_at FROM {} WHERE worker_id = ANY(%s)").format(sql.Identifier(STATS_TABLE)), (workers,)
                ).fetchall()
                if expire_at is not None
            }
        from dataclasses import replace

        return BrokerRuns(
            now_s=float(clock[0]),
            broker_up_s=float(clock[1]),
            runs=tuple(replace(run, worker_expires_s=expiry.get(run.worker)) if run.worker else run for run in runs),
        )

    def settle_crashed(self, crashed: Sequence[CrashedRun], fence: DispatchFence) -> list[SettledJob]:
        from reconciler.core.live.records import SettledJob

        if not crashed:
            return []
        self._prepare()
        settled = []
        with self._connection() as conn, conn.transaction():
            _fence(conn, fence, self._timeout)
            for item in crashed:
                run = item.run
                # Still this job's run and still active; a row another
                # transaction holds (a worker finishing it, another
                # dispatcher) is left to the next pass.
                held = conn.execute(
                    sql.SQL(
                        "SELECT f.job_id FROM fabric_lane_jobs f JOIN {} s ON s.key = f.saq_key"
                        " WHERE f.job_id = %s AND f.saq_key = %s AND s.status = 'active' FOR UPDATE OF f, s SKIP LOCKED"
                    ).format(sql.Identifier(JOBS_TABLE)),
                    (run.job_id, run.key),
                ).fetchone()
                if held is None:
                    continue
                _set_aside(conn, run.key)
                back = conn.execute(
                    "UPDATE fabric_lane_jobs SET lane = NULL, queue = NULL, saq_key = NULL, dispatched_at = NULL,"
                    " attempts = attempts + CASE WHEN cloud THEN 1 ELSE 0 END, cloud = FALSE WHERE job_id = %s RETURNING attempts",
                    (run.job_id,),
                ).fetchone()
                attempts = int(back[0]) if back else 0
                settled.append(
                    SettledJob(job_id=run.job_id, lane=run.lane, outcome="crashed", attempts=attempts, reason=f"run {run.key}: {item.reason}")
                )
        return settled

    def sweep_superseded(self) -> list[SettledJob]:
        from reconciler.core.live.records import SettledJob

        self._prepare()
        late = []
        with self._connection() as conn, conn.transaction():
            rows = conn.execute(
                sql.SQL(
                    "SELECT key, job, status, expire_at IS NOT NULL AND expire_at < EXTRACT(EPOCH FROM NOW()) FROM {}"
                    " WHERE queue = %s ORDER BY key FOR UPDATE SKIP LOCKED"
                ).format(sql.Identifier(JOBS_TABLE)),
                (SUPERSEDED_QUEUE,),
            ).fetchall()
            for key, job, status, expired in rows:
                if status in ("complete", "failed"):
                    job_id, lane = _run_of(key, job)
                    now = conn.execute("SELECT attempts FROM fabric_lane_jobs WHERE job_id = %s", (job_id,)).fetchone()
                    try:
                        late.append(
                            SettledJob(
                                job_id=job_id,
                                lane=lane,
                                outcome="superseded",
                                attempts=int(now[0]) if now else 0,
                                reason=f"run {key} finished late ({status}) after it was settled as crashed: ignored",
                            )
                        )
                    except ValueError:  # a row the fabric did not set aside (no job id of its own): cleared, not told
                        pass
                if status in ("complete", "failed", "aborted") or expired:
                    conn.execute(sql.SQL("DELETE FROM {} WHERE key = %s").format(sql.Identifier(JOBS_TABLE)), (key,))
                elif status != "aborting":
                    # Put back by its worker (a retry): aborting again, so a live worker cancels it.
                    conn.execute(sql.SQL("UPDATE {} SET status = 'aborting' WHERE key = %s").format(sql.Identifier(JOBS_TABLE)), (key,))
        return late

    def lane_states(self, queues: Mapping[str, str]) -> list[SnapshotLane]:
        from reconciler.core.live.models import SnapshotLane

        names = sorted(set(queues.values()))

        def read(conn: psycopg.Connection[Any]) -> tuple[dict[str, int], dict[str, tuple[int, float | None]]]:
            # saq's own freshness rule (PostgresQueue.info): a worker's stats
            # row is alive until its expire_at, in the database's clock.
            workers = {
                queue: (int(fresh), None if silent is None else max(0.0, float(silent)))
                for queue, fresh, silent in _rows(
                    conn,
                    sql.SQL(
                        "SELECT queue_key, count(*) FILTER (WHERE expire_at >= EXTRACT(EPOCH FROM NOW())),"
                        " EXTRACT(EPOCH FROM NOW()) - max(expire_at) FROM {} WHERE queue_key = ANY(%s) GROUP BY queue_key"
                    ).format(sql.Identifier(STATS_TABLE)),
                    (names,),
                )
            }
            return _held(conn, names), workers

        held, workers = self._reading(read)
        out = []
        for lane_id, queue in queues.items():
            fresh, silent = workers.get(queue, (0, None))
            out.append(
                SnapshotLane(
                    id=lane_id,
                    in_flight=held.get(queue, 0),
                    queue=queue,
                    workers=fresh,
                    workers_silent_s=None if fresh else silent,
                )
            )
        return out

    def phaze_agents(self, agent_ids: Sequence[str]) -> dict[str, PhazeAgentSeen]:
        """phaze's `agents` rows (phaze a3fd169 models/agent.py: id, kind,
        last_seen_at timestamptz, revoked_at timestamptz), read with plain
        SQL. Who writes them: phaze's API (each agent's heartbeat POST sets
        its own last_seen_at = now(); an operator revokes). Anything the
        table holds or lacks is an `unknown` agent with the reason, never an
        error: only an unreachable broker raises (LaneBrokerUnavailable)."""
        from reconciler.core.live.models import PhazeAgentSeen, phaze_agent_status

        ids = sorted(set(agent_ids))
        if not ids:
            return {}

        def unknown(reason: str) -> dict[str, PhazeAgentSeen]:
            return {agent_id: PhazeAgentSeen(agent_id=agent_id, reason=reason) for agent_id in ids}

        # One row's nonsense (an infinite last_seen_at) is that agent's alone.
        query = (
            "SELECT id, last_seen_at IS NULL, CASE WHEN isfinite(last_seen_at) THEN EXTRACT(EPOCH FROM (NOW() - last_seen_at))::DOUBLE PRECISION END,"
            " revoked_at IS NOT NULL FROM agents WHERE id = ANY(%s::TEXT[])"
        )
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self._dsn, autocommit=True, **_bounded(self._timeout))
                rows = self._conn.execute(query, (ids,)).fetchall()
            except psycopg.OperationalError as exc:
                self._drop()
                raise LaneBrokerUnavailable(f"phaze's broker: {_first_line(exc, self._secrets)}") from None
            except psycopg.errors.UndefinedTable:
                return unknown("phaze's agents table is not in the broker's database")
            except psycopg.Error as exc:
                return unknown(f"phaze's agents table is not as phaze makes it: {_first_line(exc, self._secrets)}")
        out = {}
        for row in rows:
            agent_id, never, seen_ago, revoked = row
            if not isinstance(agent_id, str) or agent_id not in ids:
                continue
            if not never and seen_ago is None:
                out[agent_id] = PhazeAgentSeen(agent_id=agent_id, reason="its last_seen_at is not a finite time")
                continue
            ago = None if seen_ago is None else float(seen_ago)
            out[agent_id] = phaze_agent_status(agent_id, seen_ago_s=ago, revoked=bool(revoked))
        for agent_id in ids:
            out.setdefault(agent_id, PhazeAgentSeen(agent_id=agent_id, reason="no row in phaze's agents table (not registered with phaze)"))
        return out

    def in_flight(self, queues: Sequence[str]) -> dict[str, int]:
        """Jobs queued or active on each of `queues` (0 for one with none):
        `lane_states`' in_flight alone, for a memoized pass's heartbeat, which
        builds no model."""
        names = sorted(set(queues))
        held = self._reading(lambda conn: _held(conn, names))
        return {queue: held.get(queue, 0) for queue in queues}


def _fence(conn: psycopg.Connection[Any], fence: DispatchFence, timeout_s: float) -> None:
    """`dispatch`'s fence (module docstring): the fence row locked until
    commit, then the registry's current term must be `fence.term`; the row
    records the term that dispatches. Raises StaleDispatcher."""
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{max(1, int(timeout_s * 1000))}ms")))
    row = conn.execute("SELECT epoch FROM fabric_lane_fence WHERE id = 1 FOR UPDATE").fetchone()
    if row is None:
        raise LaneBrokerError("phaze's broker: the fabric's fence row is missing (fabric lane init-roles makes it)")
    refused = fence.refusal()
    if refused is not None:
        raise StaleDispatcher(refused)
    if int(row[0]) != fence.term:
        conn.execute("UPDATE fabric_lane_fence SET epoch = %s WHERE id = 1", (fence.term,))


def _set_aside(conn: psycopg.Connection[Any], key: str) -> None:
    """The run `key` aborting on SUPERSEDED_QUEUE, kept SUPERSEDED_KEEP_S (module docstring)."""
    conn.execute(
        sql.SQL("UPDATE {} SET status = 'aborting', queue = %s, expire_at = EXTRACT(EPOCH FROM NOW())::BIGINT + %s WHERE key = %s").format(
            sql.Identifier(JOBS_TABLE)
        ),
        (SUPERSEDED_QUEUE, SUPERSEDED_KEEP_S, key),
    )


def _active_run(job_id: str, lane: str, key: str, job: Any) -> ActiveRun:
    """The facts of one active SAQ job (saq's Job.to_dict as JSON); a record
    that does not parse is named unreadable, never a crash."""
    import json

    from reconciler.core.scheduling.lanes import ActiveRun

    try:
        fields = json.loads(bytes(job))
        if not isinstance(fields, dict):
            raise ValueError("not an object")
        worker = fields.get("worker_id")
        touched = fields.get("touched") or fields.get("started") or 0
        heartbeat = fields.get("heartbeat") or 0
        if (worker is not None and not isinstance(worker, str)) or not isinstance(touched, int | float) or not isinstance(heartbeat, int | float):
            raise ValueError("fields of the wrong type")
    except (ValueError, TypeError):
        return ActiveRun(job_id=job_id, lane=lane, key=key, readable=False)
    return ActiveRun(
        job_id=job_id,
        lane=lane,
        key=key,
        worker=worker,
        touched_s=float(touched) / 1000 if touched else None,
        heartbeat_s=float(heartbeat),
    )


def _run_of(key: str, job: Any) -> tuple[str, str]:
    """The job id and lane a set-aside run was for: the job id from its key
    (`<job id>.<n>`, written by `dispatch`; a worker cannot change a key),
    the lane from its kwargs ("?" when they do not parse)."""
    import json

    lane = "?"
    try:
        kwargs = json.loads(bytes(job)).get("kwargs") or {}
        if isinstance(kwargs.get("lane"), str):
            lane = kwargs["lane"]
    except (ValueError, TypeError, AttributeError):
        pass
    return key.rsplit(".", 1)[0], lane


class _NotMadeYet(Exception):
    """saq's tables are not (all) there: a broker nobody used yet."""


def _rows(conn: psycopg.Connection[Any], query: sql.Composable, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    try:
        return conn.execute(query, params).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        raise _NotMadeYet from None


def _held(conn: psycopg.Connection[Any], queues: list[str]) -> dict[str, int]:
    """The lane slots held on each of `queues`: its saq_jobs rows not finished."""
    query = sql.SQL("SELECT queue, count(*) FROM {} WHERE queue = ANY(%s) AND status = ANY(%s) GROUP BY queue").format(sql.Identifier(JOBS_TABLE))
    return {queue: int(count) for queue, count in _rows(conn, query, (queues, list(UNFINISHED)))}


_JOB_COLUMNS = "job_id, enqueued_at, attempts, duration_s, lane, dispatched_at"


def _job(row: tuple[Any, ...]) -> QueuedJob:
    from reconciler.core.live.records import QueuedJob

    job_id, enqueued_at, attempts, duration, lane, dispatched_at = row
    return QueuedJob(
        job_id=job_id,
        enqueued_at=from_epoch_seconds(float(enqueued_at)),
        attempts=int(attempts),
        duration_s=None if duration is None else float(duration),
        lane=lane,
        dispatched_at=None if dispatched_at is None else from_epoch_seconds(float(dispatched_at)),
    )


class _HoldsConnection(Protocol):
    _dsn: str
    _timeout: float
    _secrets: Sequence[str]
    _conn: psycopg.Connection[Any] | None


@contextmanager
def broker_session(holder: _HoldsConnection) -> Iterator[psycopg.Connection[Any]]:
    """`holder`'s autocommit connection to the broker, opened when it has none
    (or it closed); psycopg's errors as the port's: unreachable (the
    connection dropped, the next session opens a new one) or refused, each
    with psycopg's first line and no secret."""
    try:
        if holder._conn is None or holder._conn.closed:
            holder._conn = psycopg.connect(holder._dsn, autocommit=True, **_bounded(holder._timeout))
        yield holder._conn
    except psycopg.OperationalError as exc:
        holder._conn = dropped(holder._conn)
        raise LaneBrokerUnavailable(f"phaze's broker: {_first_line(exc, holder._secrets)}") from None
    except psycopg.Error as exc:
        raise LaneBrokerError(f"phaze's broker refused: {_first_line(exc, holder._secrets)}") from None


def dropped(conn: psycopg.Connection[Any] | None) -> None:
    """Close `conn` quietly (it may be broken already); the holder keeps None."""
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass


def _first_line(exc: BaseException, secrets: Sequence[str] = ()) -> str:
    """The first line of `exc`'s text, without any of `secrets` (the DSN and
    its password: libpq and saq may quote them)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    for secret in sorted(secrets, key=len, reverse=True):
        line = line.replace(secret, "***")
    return line


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """What of `dsn` no message may show: the DSN itself and its password, as
    written and percent-decoded (URL form) or as a `password=` value."""
    found = [dsn]
    try:
        password = urlsplit(dsn).password
    except ValueError:
        password = None
    if password:
        found += [password, unquote(password)]
    match = re.search(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn)
    if match:
        found += [match.group(1), match.group(1).strip("'")]
    return tuple(sorted({s for s in found if len(s) >= 2}, key=len, reverse=True))


def dsn_problem(dsn: str) -> str | None:
    """Why libpq cannot use `dsn`, in words that never quote it (libpq's own
    message would: "invalid percent-encoded token: <the password>"), or None."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error:
        return "phaze's queue URL does not parse as a PostgreSQL URL (libpq refuses it; its text is not shown)"
    return None
