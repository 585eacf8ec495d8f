"""The fleet registry on an etcd cluster (v3 API through aetcd).

Keys under the configured prefix P (default "/fabric"):

    P/nodes/<host>          NodeRecord JSON under a lease whose TTL is the node
                            timeout: a silent node's key expires by itself
    P/facts/<host>          the same record without a lease (last known facts,
                            so an offline node still shows with its tier)
    P/state/<host>          NodeState JSON (the lifecycle; written by the leader)
                            without what P/facts/<host> holds: the record, and
                            an up node's last_seen (`stored_state`); a beat
                            alone does not change it
    P/drain/<host>          DrainRequest JSON (present = drained)
    P/leader                LeaderInfo JSON under the leader's lease; its create
                            revision is the term; rewritten (renewed_at) at every
                            renewal; kept, resigned and off the lease, on resignation
    P/epoch                 the epoch counter (decimal)
    P/plan-index            the newest plan's signed index (PlanIndex JSON:
                            epoch, leader, term, fleet, prefix, created, and
                            the name and digest of each part)
    P/plan-parts/<digest>   one part of a plan (reconciler.core.live.plan_parts),
                            under the digest of its bytes
    P/plan                  the whole plan as versions before the plan in parts
                            wrote it: never written nor read here any more
    P/liveness/<host>       fabric-watch's fast liveness record (issue 30):
                            {"host", "ttl_s"} on a short lease of its own,
                            kept alive every couple of seconds; gone when the
                            lease lapses (the leader's watch wakes it)
    P/scaling               ScalingRecord JSON (the leader's scaling memory and
                            concurrency overrides; written under its fence)
    P/pending/<host>        PendingRecord JSON under a lease of the node timeout:
                            a machine without a host file waiting for admission
                            (written with the joining identity; no authority:
                            the live read skips it, no snapshot holds it)
    P/members/<group>/<m>   MemberRecord JSON under a lease of the node timeout:
                            an ephemeral member of a worker group (written with
                            the group's identity, fabric-group-<group>; the
                            live read skips it, the leader admits it or not)

Election: a campaign grants a lease and, in one transaction, creates P/leader
(only if absent) and raises P/epoch (only if unchanged since read). The term is
the revision that created P/leader: etcd assigns it, no writer picks it, and a
reader takes it from the key, never from its value. Every write that needs
leadership (publish, lifecycle, scaling, renewal, resignation) is a
transaction comparing P/leader's create revision with the term and its lease
with the term's lease: when the lease lapses the key is gone, when a candidate
took over it is another key, and the write is refused (`NotLeader`).

Freshness: etcd does not check permissions on LeaseKeepAlive, and the lease id
is in P/leader for any host to read, so a lease alone cannot end a term. The
leader rewrites renewed_at at every renewal; a record not renewed within its
TTL (or resigned, or unreadable) is taken over by a campaign with a
compare-and-swap on its mod revision (delete), then the usual create: a new
term. A renewal is not a membership change for `wait_for_change`; a new term,
a resignation and the record's removal are. A live record is taken over
(`take_over`, issue 30) only by one transaction comparing its mod revision
as read and the absence of P/liveness/<leader's host> (its lease lapsed);
the record names its host's liveness expiry too (`liveness_until`), which
the key, deleted at the lapse, no longer can.

Limits: etcd refuses a transaction of more than --max-txn-ops operations
(default 128) and any request over --max-request-bytes (default 1.5 MiB). No
request here grows with the fleet: the lifecycle is written in chunks of at
most `TXN_CHUNK_OPS` writes and `TXN_CHUNK_BYTES` bytes, each chunk its own
transaction fenced by the leader key (a deposed leader writes no chunk; a fence
failing midway raises `NotLeader`, and the chunks already written are states
this leader computed while it led, which its successor re-reads and advances).
Only the states that changed are written, `TXN_IN_FLIGHT` chunks at a time.

Plan: published in parts (reconciler.core.live.plan_parts). The parts the
current index does not name are put first, in fenced transactions of at most
`TXN_CHUNK_OPS` writes and `TXN_CHUNK_BYTES` bytes (a part is keyed by its
digest: a part that did not change is never written again); then one
transaction under the fence and the epoch read puts the new index and raises
the epoch (the plan's one instant: before it readers see the old index,
after it the new one, whose parts are all there); then the parts no index
names are deleted, fenced. A reader reads the index, then the parts at the
index's revision (still there for it even once deleted), and checks each
against the index's digest: a part of another epoch, missing or tampered is
refused and named (`read_plan`). An index or a part over `TXN_CHUNK_BYTES`
is refused with a clear error instead of etcd's.
The registry is read in pages of `READ_PAGE_KEYS` keys, every page at the
revision of the first, so the read is still one consistent instant; it skips
the lane jobs and takes only the keys of the live heartbeats (their values are
the facts, read beside them), and parses a value it read or wrote before only once.

Lane jobs are not here: they live on phaze's broker (reconciler.ports.LaneBroker).
The read still skips P/jobs/, where fabrics before the lane queue kept them.

The API is synchronous. aetcd is asyncio-only, so the registry runs one event
loop on a private daemon thread and every method submits a coroutine to it and
waits. Endpoints are tried in order: when one does not answer (refused, timed
out) the next is used, and `RegistryUnavailable` is raised only when none does.
`wait_for_change` is served by a watch on P/ running on that loop.

TLS: an https:// endpoint is reached over TLS with the CA and client
certificate from [registry] ca_file / cert_file / key_file (read at open; the
key stays in memory only). The key file is refused unless it is owned by root
or this process's user and no one else may read it
(reconciler.adapters.secret_files): the error names its path and mode.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import grpc
from aetcd import rpc, transactions, utils, watcher
from aetcd.rpc import auth_pb2

from reconciler.adapters.registry_common import LifecycleMixin, LiveRead
from reconciler.adapters.registry_etcd_view import RegistryView, progress_is_trusted
from reconciler.adapters.registry_records import (
    MAX_PLAN_BYTES,
    PLAN_INDEX,
    PLAN_PARTS,
    WHAT,
    Report,
    glance_of,
    key_text,
    member_records,
    parse_int,
    parse_record,
    plan_read_of,
    read_index,
    read_plan,
    renewed_report,
    require,
    stored_plan,
)
from reconciler.adapters.secret_files import SecretFileRefused, read_secret_file
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.desired.registry_access import AccessState, AuthStep, Grant
from reconciler.core.live.beat import stamped
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
from reconciler.core.scheduling.lifecycle import NodeState, beat_expiry, heartbeat_timeout, stored_state, with_facts
from reconciler.core.scheduling.suspicion import LivenessRecord
from reconciler.core.timestamps import from_epoch_seconds, utc
from reconciler.ports import Clock, NotLeader, PermissionDenied, RegistryError, RegistryUnavailable

T = TypeVar("T")
M = TypeVar("M", NodeRecord, NodeState)

_ACCESS = {auth_pb2.Permission.READ: "read", auth_pb2.Permission.WRITE: "write", auth_pb2.Permission.READWRITE: "readwrite"}
_PERM_TYPE = {access: perm_type for perm_type, access in _ACCESS.items()}

# etcd's defaults, which a fleet's etcd keeps: --max-txn-ops and --max-request-bytes.
ETCD_MAX_TXN_OPS = 128
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
# The compares of the term's fence (`EtcdRegistry._fence`): the leader key's
# create revision and its lease.
FENCE_COMPARES = 2
# Writes per lifecycle transaction: etcd's limit, less the fence's compares
# (etcd counts the longest of the compare/success/failure lists; counting
# them together keeps us under it whichever way a version counts), less one.
TXN_CHUNK_OPS = ETCD_MAX_TXN_OPS - FENCE_COMPARES - 1
# Bytes of keys and values per transaction: two thirds of the request limit,
# leaving room for the fence compare and the protobuf framing of each op.
TXN_CHUNK_BYTES = ETCD_MAX_REQUEST_BYTES * 2 // 3
# Keys per page of a full read. gRPC's client refuses a reply over 4 MiB by
# default (etcd's replies are otherwise unbounded); a page of this many node
# states (a few KiB each at most, 50 transitions) stays well under it, and the
# channel accepts up to READ_REPLY_BYTES for a page holding a large plan.
READ_PAGE_KEYS = 1000
# Lifecycle transactions sent at once (each within the limits above).
TXN_IN_FLIGHT = 16
READ_REPLY_BYTES = 64 * 1024 * 1024

# Errors meaning "this endpoint did not answer": try the next one.
_UNREACHABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, asyncio.TimeoutError, OSError)


def _status(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status behind an aetcd error (aetcd raises its errors from the
    grpc one; PERMISSION_DENIED has no aetcd class of its own)."""
    for cause in (exc, exc.__cause__):
        if isinstance(cause, grpc.aio.AioRpcError):
            return cause.code()
    return None


def _json_or_none(value: bytes) -> Any:
    """`value` as JSON, or None when it is not (a host may write anything
    into its own keys, and its beat must still go through)."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


def lifecycle_chunks(writes: Sequence[tuple[str, bytes, bytes | None]]) -> list[list[tuple[str, bytes, bytes | None]]]:
    """`writes` (kind, key, value) cut into transactions of at most
    TXN_CHUNK_OPS writes and TXN_CHUNK_BYTES bytes of keys and values; at
    least one (maybe empty) chunk. A single write over TXN_CHUNK_BYTES is
    refused: a node state is a few KiB at most (50 transitions)."""
    chunks: list[list[tuple[str, bytes, bytes | None]]] = [[]]
    size = 0
    for write in writes:
        kind, key, value = write
        cost = len(key) + len(value or b"")
        if cost > TXN_CHUNK_BYTES:
            raise RegistryError(f"etcd: {key.decode(errors='replace')} would be {cost} bytes, over the {TXN_CHUNK_BYTES}-byte budget of one request")
        if len(chunks[-1]) >= TXN_CHUNK_OPS or size + cost > TXN_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(write)
        size += cost
    return chunks


async def _read_range(c: aetcd.Client, start: bytes, end: bytes, revision: int, *, keys_only: bool = False) -> tuple[list, int]:
    """Every key in [start, end) in pages of READ_PAGE_KEYS keys, all read at
    `revision` (0: the revision of the first page, returned): one consistent
    instant, however many pages."""
    await c.connect()
    kvs: list = []
    while True:
        request = rpc.RangeRequest(key=start, range_end=end, limit=READ_PAGE_KEYS, revision=revision, keys_only=keys_only)
        try:
            reply = await c.kvstub.Range(request, timeout=c._timeout, metadata=c.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise aetcd.ConnectionFailedError(exc.details()) from exc
            raise aetcd.ClientError(exc.details()) from exc
        revision = revision or reply.header.revision
        kvs.extend(reply.kvs)
        if not reply.more or not reply.kvs:
            return kvs, revision
        start = reply.kvs[-1].key + b"\0"


async def _read_live(c: aetcd.Client, base: bytes, with_plan: bool = True) -> tuple[list[tuple[bytes, bytes]], list[bytes], int]:
    """What `EtcdRegistry._read` needs under `base` (the prefix with its
    slash), at one revision: every key and value except the lane jobs (the
    read has no use for them, and a queue may be long), and the keys only of
    the live heartbeats (base + "nodes/"): a beat writes the same value to
    facts/, which is read whole, so only which beats are alive is news.
    Without `with_plan`, not the plan's parts either.
    Returns (key, value) pairs with `base` cut off, the live node ids, and
    the revision read."""
    jobs, members, nodes, pending = base + b"jobs/", base + b"members/", base + b"nodes/", base + b"pending/"
    jobs_end, nodes_end = utils.prefix_range_end(jobs), utils.prefix_range_end(nodes)
    # etcd orders keys bytewise: drain, epoch, facts < jobs < lanes, leader < members < nodes < pending < plan, scaling, state.
    # The pending and member reports carry no authority and are not the lifecycle's: skipped too
    # (the leader reads the members on their own: `group_members`).
    before_jobs, revision = await _read_range(c, base, jobs, 0)
    between, _ = await _read_range(c, jobs_end, members, revision)
    between_members, _ = await _read_range(c, utils.prefix_range_end(members), nodes, revision)
    beats, _ = await _read_range(c, nodes, nodes_end, revision, keys_only=True)
    before_pending, _ = await _read_range(c, nodes_end, pending, revision)
    after_pending, end = utils.prefix_range_end(pending), utils.prefix_range_end(base)
    if with_plan:
        after, _ = await _read_range(c, after_pending, end, revision)
        tail: list = []
    else:  # without the plan's parts (`with_plan`: a host's own state)
        parts = base + f"{PLAN_PARTS}/".encode()
        after, _ = await _read_range(c, after_pending, parts, revision)
        tail, _ = await _read_range(c, utils.prefix_range_end(parts), end, revision)
    cut = len(base)
    pairs = [(kv.key[cut:], kv.value) for kvs in (before_jobs, between, between_members, before_pending, after, tail) for kv in kvs]
    return pairs, [kv.key[len(nodes) :] for kv in beats], revision


async def _current_revision(c: aetcd.Client, key: bytes) -> int:
    """etcd's current revision (the header of a one-key count: a few bytes)."""
    await c.connect()
    request = rpc.RangeRequest(key=key, count_only=True)
    try:
        reply = await c.kvstub.Range(request, timeout=c._timeout, metadata=c.metadata)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise aetcd.ConnectionFailedError(exc.details()) from exc
        raise aetcd.ClientError(exc.details()) from exc
    return reply.header.revision


async def _server_version(c: aetcd.Client) -> str | None:
    """The version of the etcd member this client talks to (its Status), or
    None when it does not say (an auth that refuses Status, an old member):
    a view then trusts no progress answer (registry_etcd_view)."""
    try:
        reply = await c.maintenancestub.Status(rpc.StatusRequest(), timeout=c._timeout, metadata=c.metadata)
    except grpc.aio.AioRpcError:
        return None
    return str(reply.version) or None


class _LeaseCompare(transactions.BaseCompare):
    """A compare of the lease a key is attached to (etcd's LEASE target, which aetcd 1.0 does not offer)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = rpc.Compare.LEASE
        compare.lease = int(self.value)


class _HostFollow:
    """What the watch of one host's entries reported and not yet handed over
    (filled on the loop thread, taken by `EtcdRegistry.watch_host`)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.task: asyncio.Task | None = None
        self._ready = threading.Condition()
        self._changes: list[EntryVersion] = []
        self._failure: str | None = None

    def put(self, changes: list[EntryVersion]) -> None:
        with self._ready:
            self._changes.extend(changes)
            self._ready.notify_all()

    def fail(self, reason: str) -> None:
        with self._ready:
            self._failure = reason
            self._ready.notify_all()

    def take(self, timeout_s: float) -> tuple[list[EntryVersion], str | None]:
        """The changes so far (waiting up to `timeout_s` for one), or none and
        why the watch ended."""
        with self._ready:
            self._ready.wait_for(lambda: self._changes or self._failure is not None, timeout_s)
            changes, self._changes = self._changes, []
            return changes, (self._failure if not changes else None)


class _Client(aetcd.Client):
    """aetcd's client with TLS: aetcd 1.0 only opens plaintext channels."""

    def __init__(self, host: str, port: int, *, credentials: grpc.ChannelCredentials | None, timeout: float) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options={"grpc.max_receive_message_length": READ_REPLY_BYTES})
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        options = list(self._options.items())
        if self._credentials is None:
            self.channel = rpc.insecure_channel(target, options=options)
        else:
            self.channel = rpc.secure_channel(target, self._credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


class _Parsed:
    """What `EtcdRegistry._parse_pairs` found in one read."""

    def __init__(self) -> None:
        self.facts: dict[str, NodeRecord] = {}
        self.stored: dict[str, NodeState] = {}
        self.drains: dict[str, DrainRequest] = {}
        self.leader: LeaderInfo | None = None
        self.epoch = 0
        self.concurrency: dict[str, int] = {}
        self.problems: list[UnreadableRecord] = []
        self.index_bytes: bytes | None = None
        self.plan_parts: dict[str, bytes] = {}

    def take(self, kind: str, node: str, model: NodeRecord | NodeState | None, problem: UnreadableRecord | None) -> None:
        """A node's facts or stored state (or why it does not parse)."""
        if isinstance(model, NodeRecord):
            self.facts[node] = model
        elif isinstance(model, NodeState):
            self.stored[node] = model
        if problem is not None:
            self.problems.append(problem)

    def other(self, key: str, kind: str, node: str, value: bytes) -> None:
        """Any other key: drains, the plan's index and parts, the leader, the epoch, the scaling record."""
        problem: UnreadableRecord | None = None
        if kind == "drain" and node:
            drain, problem = parse_record(DrainRequest, value, key=key, node=node)
            if drain is not None:
                self.drains[node] = drain
        elif key == PLAN_INDEX:
            self.index_bytes = value
        elif kind == PLAN_PARTS and node:
            self.plan_parts[node] = value
        elif key == "leader":
            self.leader, problem = parse_record(LeaderInfo, value, key=key)
        elif key == "epoch":
            counter, problem = parse_int(value, key=key)
            self.epoch = counter or 0
        elif key == "scaling":
            scaling, problem = parse_record(ScalingRecord, value, key=key, limit=MAX_PLAN_BYTES)
            self.concurrency = dict(scaling.concurrency) if scaling is not None else {}
        if problem is not None:
            self.problems.append(problem)


class EtcdRegistry(LifecycleMixin):
    def __init__(
        self,
        endpoints: list[str],
        *,
        prefix: str = "/fabric",
        timing: TimingSettings,
        flap: FlapSettings,
        clock: Clock,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        op_timeout_s: float = 3.0,
        informer: bool = True,
    ) -> None:
        if not endpoints:
            raise ValueError("the etcd registry needs at least one endpoint")
        self.timing = timing
        self.flap = flap
        self._clock = clock
        self._prefix = prefix.rstrip("/")
        self._op_timeout = op_timeout_s
        self._endpoints = [urlsplit(e) for e in endpoints]
        self._credentials = self._load_credentials(ca_file, cert_file, key_file)
        self._identity = f"the identity of {cert_file}" if cert_file else "a client without a certificate"
        self._current = 0
        self._client: _Client | None = None
        self._changed = threading.Event()
        self._watch_task: asyncio.Task | None = None
        # watch_host's watch of one host's entries (fabric watch).
        self._host_follow: _HostFollow | None = None
        # keep_alive: the lease of each host's liveness record this client keeps alive.
        self._liveness_leases: dict[str, tuple[int, float]] = {}
        self._closed = False
        # Values of the last read (and the states this leader wrote since) by
        # their bytes, parsed (or why they do not parse): see `_parsed`.
        self._record_memo: dict[bytes, NodeRecord | str] = {}
        self._state_memo: dict[bytes, NodeState | str] = {}
        # The plan of the last index read, by the index's bytes (parts joined once).
        self._plan_memo: tuple[bytes, FleetPlan] | None = None
        # The last read's facts and states by key: (value, kind, node, model, problem) (`_parse_pairs`),
        # each state joined with its facts (`_joined_states`), and each live record's expiry (`_alive`).
        self._by_key: dict[bytes, tuple[bytes, str, str, NodeRecord | NodeState | None, UnreadableRecord | None]] = {}
        self._joined: dict[str, tuple[NodeState, NodeRecord | None, NodeState]] = {}
        self._expiries: dict[str, tuple[NodeRecord, datetime | None]] = {}
        # The parts' bytes and digests of the plans published before (a part
        # that did not change is not made again: plan_parts.PartsMemo).
        self._parts_memo = PartsMemo()
        # The leader's view of the registry kept from a watch (registry_etcd_view):
        # started by the first full read, dropped when it may be stale.
        self._informer = informer
        self._view: RegistryView | None = None
        self.full_reads = 0
        self.view_reads = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fabric-etcd", daemon=True)
        self._thread.start()

    @staticmethod
    def _load_credentials(ca_file: str | None, cert_file: str | None, key_file: str | None) -> grpc.ChannelCredentials | None:
        if not (ca_file or cert_file or key_file):
            return None
        try:
            ca = Path(ca_file).read_bytes() if ca_file else None
            cert = Path(cert_file).read_bytes() if cert_file else None
        except OSError as exc:
            raise RegistryError(f"etcd TLS file: {exc}") from exc
        try:
            # The key is a secret: only a file no one else may read (secret_files).
            key = read_secret_file(key_file, "the etcd client key") if key_file else None
        except SecretFileRefused as exc:
            raise RegistryError(f"etcd TLS file: {exc}") from None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    # -- the loop thread and endpoint failover ------------------------------------

    def _key(self, *parts: str) -> bytes:
        return "/".join((self._prefix, *parts)).encode()

    def _make_client(self) -> _Client:
        url = self._endpoints[self._current]
        tls = url.scheme == "https"
        if tls and self._credentials is None:
            credentials = grpc.ssl_channel_credentials()
        else:
            credentials = self._credentials if tls else None
        return _Client(url.hostname or "127.0.0.1", url.port or 2379, credentials=credentials, timeout=self._op_timeout)

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self._op_timeout)
            except Exception:  # a dead channel may fail to close; it is dropped anyway
                pass

    async def _with_failover(self, op: Callable[[_Client], Awaitable[T]]) -> T:
        last: BaseException | None = None
        failed = 0
        lost = 0
        while failed < len(self._endpoints):
            if self._client is None:
                self._client = self._make_client()
            client = self._client
            try:
                return await asyncio.wait_for(op(client), self._op_timeout * 2)
            except _UNREACHABLE as exc:
                last = exc
                failed += 1
                if self._client is client:
                    await self._drop_client()
                    self._current = (self._current + 1) % len(self._endpoints)
            except asyncio.CancelledError as exc:
                # gRPC cancels every call in flight on a channel that is closed:
                # another call's failover (or the view's) dropped this client
                # under this request. Not a cancellation of this request itself
                # (close(), _call's deadline): try once more on a fresh client,
                # the endpoint is not at fault.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                last = exc
                if lost >= 1:
                    break
                lost += 1
                if self._client is client:
                    await self._drop_client()
        names = ", ".join(e.geturl() for e in self._endpoints)
        detail = str(last) or f"{type(last).__name__} (the connection closed under the request)"
        raise RegistryUnavailable(f"no etcd endpoint answers ({names}): {detail}")

    def _call(self, op: Callable[[_Client], Awaitable[T]], what: str = "the request") -> T:
        if self._closed:
            raise RegistryError("registry is closed")
        future = asyncio.run_coroutine_threadsafe(self._with_failover(op), self._loop)
        try:
            return future.result(timeout=self._op_timeout * 2 * len(self._endpoints) + 5)
        except TimeoutError as exc:
            future.cancel()
            raise RegistryUnavailable(f"etcd did not answer in time: {exc}") from exc
        except aetcd.ClientError as exc:
            if _status(exc) == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(
                    f"etcd refused {what} to {self._identity}: permission denied (a host writes only its own "
                    f"{self._prefix}/nodes/<host> and {self._prefix}/facts/<host>; the leader's keys, drains and lanes "
                    "need a leader candidate's certificate; `fabric registry init-auth` grants what the desired state declares)"
                ) from exc
            raise RegistryError(f"etcd: {what}: {exc}") from exc

    def close(self) -> None:
        if self._closed:
            return

        async def shutdown() -> None:
            follow = self._host_follow.task if self._host_follow is not None else None
            if self._view is not None:
                await self._view.stop()
            for task in (self._watch_task, follow):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except BaseException:
                        pass
            await self._drop_client()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=self._op_timeout + 5)
        except Exception:
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _now(self) -> float:
        return self._clock.now()

    # -- nodes ------------------------------------------------------------------------

    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        ttl = float(ttl_s if ttl_s is not None else heartbeat_timeout(self.timing, record.relayed))
        return NodeRecord.model_validate(self.heartbeat_json(record.model_dump(mode="json"), ttl))

    def heartbeat_json(self, record: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        """`heartbeat` on the record's JSON object (validated when it was
        measured: a memoized pass re-sends the last full pass's); the record as stored."""
        ttl = float(ttl_s)
        node_id = record["node_id"]
        node_key, facts_key = self._key("nodes", node_id), self._key("facts", node_id)

        async def op(c: _Client) -> dict[str, Any]:
            # Keep the node's lease when it is still alive and of the same TTL
            # (one lease per node, not one per beat); otherwise grant a new one.
            lease_id = 0
            kv = await c.get(node_key)
            # The beat's time is taken just before its lease is refreshed or
            # granted, not before connecting (which a loaded host may take
            # seconds to do): the lease, the node's liveness, then lapses at
            # beat_at + ttl plus one round trip, the moment the leader
            # expects from the node's last beat, and never before it.
            stored = stamped(record, now=self._now(), ttl_s=ttl)
            if kv is not None and kv.lease:
                previous = _json_or_none(kv.value)
                if isinstance(previous, dict) and previous.get("timeout_s") == ttl:
                    reply = await c.refresh_lease(kv.lease)
                    if reply is not None and reply.TTL > 0:
                        lease_id = kv.lease
            tx = c.transactions
            for _ in range(2):
                if not lease_id:
                    stored = stamped(record, now=self._now(), ttl_s=ttl)
                    lease_id = (await c.lease(math.ceil(ttl))).id
                value = json.dumps(stored, separators=(",", ":"), ensure_ascii=False).encode()
                try:
                    await c.transaction(compare=[], success=[tx.put(node_key, value, lease=lease_id), tx.put(facts_key, value)], failure=[])
                    return stored
                except aetcd.ClientError as exc:
                    # The kept lease lapsed between its refresh and the write.
                    if "lease not found" not in str(exc):
                        raise
                    lease_id = 0
            raise RegistryError(f"heartbeat of {node_id}: its lease kept lapsing")

        return self._call(op, f"the heartbeat of {node_id}")

    # -- fast liveness (issue 30) ------------------------------------------------------

    def keep_alive(self, host: str, ttl_s: float) -> LivenessRecord:
        """One LeaseKeepAlive of the record's lease while it lives; else a new
        lease and one put of P/liveness/<host> on it (a host's identity may
        write only its own: `fabric registry init-auth`)."""
        key = self._key("liveness", check_node_id(host))
        ttl = max(1, math.ceil(ttl_s))
        value = json.dumps({"host": host, "ttl_s": ttl}, separators=(",", ":")).encode()

        async def op(c: _Client) -> LivenessRecord:
            held = self._liveness_leases.get(host)
            if held is not None and held[1] == ttl:
                reply = await c.refresh_lease(held[0])
                if reply is not None and reply.TTL > 0:
                    return LivenessRecord(host=host, expires_at=from_epoch_seconds(self._now() + reply.TTL), ttl_s=ttl)
            for _ in range(2):
                lease = (await c.lease(ttl)).id
                self._liveness_leases[host] = (lease, ttl)
                try:
                    await c.put(key, value, lease=lease)
                    return LivenessRecord(host=host, expires_at=from_epoch_seconds(self._now() + ttl), ttl_s=ttl)
                except aetcd.ClientError as exc:
                    if "lease not found" not in str(exc):
                        raise
            raise RegistryError(f"liveness of {host}: its lease kept lapsing")

        return self._call(op, f"the liveness of {host}")

    def report_edge_upstreams(self, edge: str, record: bytes) -> None:
        """One put of P/edge-upstreams/<edge> (no lease: the record's `at`
        says how fresh it is; an edge's identity may write only its own)."""
        key = self._key("edge-upstreams", check_node_id(edge))

        async def op(c: _Client) -> None:
            await c.put(key, bytes(record))

        self._call(op, f"the edge upstreams of {edge}")

    def edge_upstreams(self) -> dict[str, bytes]:
        prefix = self._key("edge-upstreams") + b"/"

        async def op(c: _Client) -> dict[str, bytes]:
            return {kv.key[len(prefix) :].decode(errors="replace"): bytes(kv.value) for kv in await c.get_prefix(prefix)}

        return self._call(op, "reading the edge upstreams")

    def liveness(self) -> list[LivenessRecord]:
        """Each live record with its lease's remaining TTL (one lease read per
        record: a small fleet's handful). A record that does not parse, or
        whose key names another host, is no liveness."""
        prefix = self._key("liveness") + b"/"

        async def op(c: _Client) -> list[LivenessRecord]:
            out = []
            for kv in await c.get_prefix(prefix):
                host = kv.key[len(prefix) :].decode(errors="replace")
                parsed = _json_or_none(kv.value)
                if not isinstance(parsed, dict) or parsed.get("host") != host or not kv.lease:
                    continue
                try:
                    check_node_id(host)
                except ValueError:
                    continue
                info = await c.get_lease_info(kv.lease)
                if info is None or info.TTL <= 0:
                    continue
                out.append(LivenessRecord(host=host, expires_at=from_epoch_seconds(self._now() + info.TTL), ttl_s=float(info.grantedTTL)))
            return sorted(out, key=lambda r: r.host)

        return self._call(op, "reading the liveness records")

    # -- pending machines (no authority: never part of the snapshot) ---------------------

    def report_pending(self, record: PendingRecord, ttl_s: float) -> PendingRecord:
        node_id = check_node_id(record.node_id)
        return self._report(record, f"pending/{node_id}", node_id, ttl_s, f"pending report of {node_id}")

    def _report(self, record: Report, name: str, node_id: str, ttl_s: float, what: str) -> Report:
        """Put a report (pending or member: no authority) at key `name` on a
        lease of its own of `ttl_s`, keeping the first_seen of the report it
        replaces; the replaced report's lease is revoked after the put."""
        key = self._key(*name.split("/"))

        async def op(c: _Client) -> Report:
            kv = await c.get(key)
            earlier = kv.value if kv is not None else None
            stored, value = renewed_report(record, earlier, key=name, node=node_id, now=from_epoch_seconds(self._now()), ttl_s=ttl_s, what=what)
            lease = await c.lease(math.ceil(float(ttl_s)))
            await c.put(key, value, lease=lease.id)
            if kv is not None and kv.lease:
                try:
                    await c.revoke_lease(kv.lease)  # the earlier report's lease (its key is rewritten already)
                except aetcd.ClientError:
                    pass
            return stored

        return self._call(op, f"the {what}")

    def pending_nodes(self) -> tuple[list[PendingRecord], list[str]]:
        start = self._key("pending") + b"/"

        async def op(c: _Client) -> list:
            kvs, _ = await _read_range(c, start, utils.prefix_range_end(start), 0)
            return kvs

        records: dict[str, PendingRecord] = {}
        problems: list[str] = []
        for kv in self._call(op, "reading the pending reports"):
            node = key_text(kv.key[len(start) :])
            parsed, problem = parse_record(PendingRecord, kv.value, key=f"pending/{node}", node=node)
            if parsed is not None and parsed.node_id != node:
                problems.append(f"{node}: unreadable pending report: names another host ({parsed.node_id})")
            elif parsed is not None:
                records[node] = parsed
            elif problem is not None:
                problems.append(problem.line())
        return [records[k] for k in sorted(records)], problems

    # -- group members (admitted by the leader, never by these keys) ----------------------

    def report_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        node_id, group = check_node_id(record.node_id), check_node_id(record.group)
        return self._report(record, f"members/{group}/{node_id}", node_id, ttl_s, f"member report of {group}/{node_id}")

    def group_members(self) -> tuple[list[MemberRecord], list[str]]:
        start = self._key("members") + b"/"

        async def op(c: _Client) -> list:
            kvs, _ = await _read_range(c, start, utils.prefix_range_end(start), 0)
            return kvs

        return member_records([(key_text(kv.key[len(start) :]), kv.value) for kv in self._call(op, "reading the member reports")])

    def set_drain(self, node_id: str, grace_s: float = 0, reason: str = "operator drain") -> DrainRequest:
        request = DrainRequest(node_id=check_node_id(node_id), requested_at=from_epoch_seconds(self._now()), grace_s=grace_s, reason=reason)
        key, value = self._key("drain", node_id), request.model_dump_json().encode()

        async def op(c: _Client) -> None:
            await c.put(key, value)

        self._call(op, f"the drain of {node_id}")
        return request

    def clear_drain(self, node_id: str) -> bool:
        key = self._key("drain", node_id)

        async def op(c: _Client) -> bool:
            return bool(await c.delete(key))

        return self._call(op, f"lifting the drain of {node_id}")

    # -- leadership and the plan ----------------------------------------------------------

    @staticmethod
    def _leader_value(info: LeaderInfo) -> bytes:
        # The term is the key's create revision, never part of its value.
        return info.model_dump_json(exclude={"term"}).encode()

    @staticmethod
    def _leader_of(kv: Any) -> LeaderInfo | None:
        """The leader record in `kv`, its term the key's create revision (a
        writer cannot choose it); None when the value does not parse (whatever
        its bytes: registry_records.parse_record never raises)."""
        info, _ = parse_record(LeaderInfo, kv.value, key="leader")
        return None if info is None else info.model_copy(update={"term": int(kv.create_revision)})

    def _fence(self, c: _Client, leadership: Leadership) -> list[Any]:
        """The compares every write of a term makes: the leader key is the one
        its campaign created (its create revision is the term) and still on
        the term's lease (a resigned record has none)."""
        leader_key = self._key("leader")
        return [c.transactions.create(leader_key) == leadership.term, _LeaseCompare(leader_key) == int(leadership.info.token)]

    def campaign(self, candidate: str, ttl_s: float) -> Leadership | None:
        leader_key = self._key("leader")

        async def op(c: _Client) -> Leadership | None:
            tx = c.transactions
            now = from_epoch_seconds(self._now())
            held = await c.get(leader_key)
            if held is not None:
                info = self._leader_of(held)
                if info is not None and info.live_at(now):
                    return None
                # Resigned, stale (not renewed within its TTL, whoever keeps
                # its lease alive) or unreadable: removed, only if it is still
                # the record just read; then campaign as for an empty seat.
                taken, _ = await c.transaction(compare=[tx.mod(leader_key) == held.mod_revision], success=[tx.delete(leader_key)], failure=[])
                if not taken:
                    return None
            return await self._claim(c, candidate, ttl_s, now)

        return self._call(op, f"the campaign of {candidate}")

    def take_over(self, candidate: str, ttl_s: float, held: LeaderInfo) -> Leadership | None:
        """The record removed only if it is still `held` (its mod revision
        as read, the same term, token and renewal) and its host's liveness
        key is gone (a lease that lapsed), in one transaction; then the
        campaign's create: a new term, whose fence refuses every write of
        the old one."""
        leader_key, live_key = self._key("leader"), self._key("liveness", check_node_id(held.candidate))

        async def op(c: _Client) -> Leadership | None:
            tx = c.transactions
            now = from_epoch_seconds(self._now())
            kv = await c.get(leader_key)
            info = self._leader_of(kv) if kv is not None else None
            if kv is None or info is None or (info.term, info.token, info.renewed_at) != (held.term, held.token, held.renewed_at):
                return None
            taken, _ = await c.transaction(
                compare=[tx.mod(leader_key) == kv.mod_revision, tx.version(live_key) == 0], success=[tx.delete(leader_key)], failure=[]
            )
            if not taken:
                return None
            return await self._claim(c, candidate, ttl_s, now)

        return self._call(op, f"{candidate}'s takeover from {held.candidate}")

    async def _claim(self, c: _Client, candidate: str, ttl_s: float, now: datetime) -> Leadership | None:
        """The campaign's create of the leader key on a new lease, with the
        epoch raised, only while the key is absent (None: another won)."""
        leader_key, epoch_key = self._key("leader"), self._key("epoch")
        tx = c.transactions
        lease = await c.lease(math.ceil(ttl_s))
        for _ in range(10):
            current = await c.get(epoch_key)
            if current is None:
                epoch, same_epoch = 1, tx.version(epoch_key) == 0
            else:
                epoch, same_epoch = int(current.value) + 1, tx.mod(epoch_key) == current.mod_revision
            info = LeaderInfo(candidate=candidate, epoch=epoch, since=now, token=str(lease.id), renewed_at=now, ttl_s=ttl_s)
            won, replies = await c.transaction(
                compare=[tx.version(leader_key) == 0, same_epoch],
                success=[
                    tx.put(leader_key, self._leader_value(info), lease=lease.id),
                    tx.put(epoch_key, str(epoch).encode()),
                    tx.get(leader_key),
                ],
                failure=[tx.get(leader_key)],
            )
            if won:
                # The term: the revision that created the key, which etcd assigned.
                term = int(replies[2][0][1].create_revision)
                return Leadership(info=info.model_copy(update={"term": term}), ttl_s=ttl_s)
            if replies and replies[0]:  # someone else leads
                break
        await c.revoke_lease(lease.id)
        return None

    def renew(self, leadership: Leadership) -> bool:
        """Refresh the lease, and rewrite the record's renewed_at under the
        term's fence: a record nobody rewrites goes stale however long its
        lease lives (anyone may keep a lease alive)."""
        leader_key = self._key("leader")

        async def op(c: _Client) -> bool:
            reply = await c.refresh_lease(int(leadership.info.token))
            if reply is None or reply.TTL <= 0:
                return False
            renewed = leadership.info.model_copy(update={"renewed_at": from_epoch_seconds(self._now()), "ttl_s": leadership.ttl_s})
            tx = c.transactions
            try:
                ok, _ = await c.transaction(
                    compare=self._fence(c, leadership),
                    success=[tx.put(leader_key, self._leader_value(renewed), lease=int(leadership.info.token))],
                    failure=[],
                )
            except aetcd.ClientError as exc:
                if "lease not found" in str(exc):  # the lease lapsed since its refresh
                    return False
                raise
            return bool(ok)

        return self._call(op, f"renewing {leadership.candidate}'s term")

    def resign(self, leadership: Leadership) -> None:
        """The record stays, marked resigned and off the lease: its term stays
        the registry's current one (hosts keep applying its plan) until a
        candidate campaigns, which takes the record over."""
        leader_key = self._key("leader")
        resigned = leadership.info.model_copy(update={"resigned": True, "renewed_at": from_epoch_seconds(self._now())})

        async def op(c: _Client) -> None:
            tx = c.transactions
            await c.transaction(compare=self._fence(c, leadership), success=[tx.put(leader_key, self._leader_value(resigned))], failure=[])
            await c.revoke_lease(int(leadership.info.token))

        self._call(op, f"{leadership.candidate}'s resignation")

    def leader(self) -> LeaderInfo | None:
        key = self._key("leader")

        async def op(c: _Client) -> LeaderInfo | None:
            kv = await c.get(key)
            if kv is None:
                return None
            info = self._leader_of(kv)
            if info is None:  # an unreadable record: the registry's own error, naming why
                require(parse_record(LeaderInfo, kv.value, key="leader"), f"etcd {key.decode()}")
            assert info is not None
            return info if info.live_at(from_epoch_seconds(self._now())) else None

        return self._call(op, "reading the leader")

    def leader_term(self) -> LeaderInfo | None:
        key = self._key("leader")

        async def op(c: _Client) -> LeaderInfo | None:
            kv = await c.get(key)
            return self._leader_of(kv) if kv is not None else None

        return self._call(op, "reading the leader's term")

    def epoch(self) -> int:
        key = self._key("epoch")

        async def op(c: _Client) -> int:
            kv = await c.get(key)
            return require(parse_int(kv.value, key="epoch"), f"etcd {key.decode()}") if kv is not None else 0

        return self._call(op, "reading the epoch")

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        """The plan in parts (module docstring, Plan): the parts the current
        index does not name, in fenced transactions within etcd's limits;
        then, in one transaction under the fence and the epoch read, the new
        index and the epoch; then the parts no index names any more, deleted."""
        epoch_key, index_key = self._key("epoch"), self._key(PLAN_INDEX)

        async def op(c: _Client) -> FleetPlan:
            tx = c.transactions
            held = await c.get(index_key)
            before, _ = parse_record(PlanIndex, held.value, key=PLAN_INDEX, limit=MAX_PLAN_BYTES) if held is not None else (None, None)
            kept = set(before.parts.values()) if before is not None else set()
            for _ in range(10):
                current = await c.get(epoch_key)
                epoch = int(current.value) + 1 if current is not None else 1
                same_epoch = tx.mod(epoch_key) == current.mod_revision if current is not None else tx.version(epoch_key) == 0
                stored = stored_plan(
                    plan.model_copy(update={"epoch": epoch, "leader": leadership.candidate, "term": leadership.term}),
                    budget=TXN_CHUNK_BYTES,
                    memo=self._parts_memo,
                )
                await self._put_parts(c, leadership, [(d, v) for d, v in sorted(stored.parts.items()) if d not in kept])
                kept |= set(stored.parts)
                ok, replies = await c.transaction(
                    compare=[*self._fence(c, leadership), same_epoch],
                    success=[tx.put(epoch_key, str(epoch).encode()), tx.put(index_key, stored.index_bytes)],
                    failure=[tx.get(self._key("leader"))],
                )
                if ok:
                    await self._drop_parts(c, leadership, set(stored.parts))
                    return stored.plan
                self._not_leader(leadership, replies)
            raise RegistryError("publish kept racing with epoch changes")

        return self._call(op, f"publishing {leadership.candidate}'s plan")

    def _not_leader(self, leadership: Leadership, replies: Any) -> None:
        """After a failed fenced transaction: NotLeader when the term is over (else the epoch moved)."""
        held = replies[0][0][1] if replies and replies[0] else None
        if held is None or (held.create_revision, held.lease) != (leadership.term, int(leadership.info.token)):
            info = self._leader_of(held) if held is not None else None
            who = f"{info.candidate} leads" if info is not None and not info.resigned else "nobody leads"
            raise NotLeader(f"{leadership.candidate}'s term of epoch {leadership.epoch} is over ({who})")

    async def _fenced_chunks(self, c: _Client, leadership: Leadership, writes: list[tuple[str, bytes, bytes | None]]) -> None:
        """`writes` in transactions within etcd's limits (`lifecycle_chunks`), each fenced by the term."""
        tx = c.transactions
        for chunk in lifecycle_chunks(writes):
            if not chunk:
                continue
            ops = [tx.put(key, value) if kind == "put" and value is not None else tx.delete(key) for kind, key, value in chunk]
            ok, replies = await c.transaction(compare=self._fence(c, leadership), success=ops, failure=[tx.get(self._key("leader"))])
            if not ok:
                self._not_leader(leadership, replies)
                raise NotLeader(f"{leadership.candidate}'s term of epoch {leadership.epoch} is over")

    async def _put_parts(self, c: _Client, leadership: Leadership, parts: list[tuple[str, bytes]]) -> None:
        await self._fenced_chunks(c, leadership, [("put", self._key(PLAN_PARTS, digest), value) for digest, value in parts])

    async def _drop_parts(self, c: _Client, leadership: Leadership, named: set[str]) -> None:
        """Delete every part the newest index does not name (the last index's,
        and any a publish that failed midway left). A reader of an older index
        reads its parts at that index's revision, where they still are."""
        start = self._key(PLAN_PARTS, "")
        kvs, _ = await _read_range(c, start, utils.prefix_range_end(start), 0, keys_only=True)
        stale = [kv.key for kv in kvs if kv.key[len(start) :].decode(errors="replace") not in named]
        await self._fenced_chunks(c, leadership, [("delete", key, None) for key in stale])

    def newest_plan(self) -> FleetPlan | None:
        """The index, then its parts at the index's revision (never a part of
        another epoch), each checked against the index's digest."""
        index_key, start = self._key(PLAN_INDEX), self._key(PLAN_PARTS, "")

        async def op(c: _Client) -> tuple[bytes, dict[str, bytes]] | None:
            found, revision = await _read_range(c, index_key, index_key + b"\0", 0)
            if not found:
                return None
            kvs, _ = await _read_range(c, start, utils.prefix_range_end(start), revision)
            return found[0].value, {kv.key[len(start) :].decode(errors="replace"): kv.value for kv in kvs}

        read = self._call(op, "reading the plan")
        if read is None:
            return None
        index_bytes, parts = read
        return require(read_plan(index_bytes, parts.get, where=f"etcd {index_key.decode()}"), f"etcd {index_key.decode()}")

    def plan_glance(self, host: str) -> tuple[int, dict[str, str]] | None:
        """One key read: the index (`glance_of`)."""
        index_key = self._key(PLAN_INDEX)

        async def op(c: _Client) -> bytes | None:
            found, _ = await _read_range(c, index_key, index_key + b"\0", 0)
            return found[0].value if found else None

        raw = self._call(op, "reading the plan's index")
        return None if raw is None else glance_of(raw, host, where=f"etcd {index_key.decode()}")

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        """The index, then only the parts `choose` names, each one key read at
        the index's revision (still there even once a newer epoch dropped
        it), checked against the index's digest: no other part is read."""
        index_key = self._key(PLAN_INDEX)
        where = f"etcd {index_key.decode()}"

        async def op(c: _Client) -> tuple[PlanIndex, list[str], dict[str, bytes]] | None:
            found, revision = await _read_range(c, index_key, index_key + b"\0", 0)
            if not found:
                return None
            index = read_index(found[0].value, where=where)
            names = sorted(set(choose(index)))
            keys = [self._key(PLAN_PARTS, index.parts[name]) for name in names if name in index.parts]
            reads = await asyncio.gather(*(_read_range(c, key, key + b"\0", revision) for key in keys))
            start = len(self._key(PLAN_PARTS, ""))
            return index, names, {kv.key[start:].decode(errors="replace"): kv.value for kvs, _ in reads for kv in kvs}

        read = self._call(op, "reading this host's part of the plan")
        if read is None:
            return None
        index, names, parts = read
        return plan_read_of(index, names, parts.get, where=where)

    # -- scaling --------------------------------------------------------------------------

    def scaling_record(self) -> ScalingRecord:
        key = self._key("scaling")

        async def op(c: _Client) -> ScalingRecord:
            kv = await c.get(key)
            # One that does not parse is skipped like any record (the full
            # read names it): the leader starts a new memory and overwrites it.
            record, _ = parse_record(ScalingRecord, kv.value, key="scaling", limit=MAX_PLAN_BYTES) if kv is not None else (None, None)
            return record or ScalingRecord()

        return self._call(op, "reading the scaling record")

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        key = self._key("scaling")

        async def op(c: _Client) -> None:
            tx = c.transactions
            ok, _ = await c.transaction(compare=self._fence(c, leadership), success=[tx.put(key, record.model_dump_json().encode())], failure=[])
            if not ok:
                raise NotLeader(f"{leadership.candidate}'s term of epoch {leadership.epoch} is over")

        self._call(op, f"storing {leadership.candidate}'s scaling record")

    # -- reading it all, and the leader's lifecycle -----------------------------------------

    def _parsed(
        self,
        memo: dict[bytes, M | str],
        seen: dict[bytes, M | str],
        value: bytes,
        model: type[M],
        *,
        key: str,
        node: str,
        ready: tuple[bytes, Any] | None = None,
    ) -> tuple[M | None, UnreadableRecord | None]:
        """`value` parsed as `model` (or why it does not parse: `parse_record`),
        parsed once: the same bytes in the last read (or just written by this
        leader, or parsed by the view as it arrived: `ready`) give the same
        model, or the same reason."""
        parsed = seen.get(value)
        if parsed is None and ready is not None and ready[0] == value and isinstance(ready[1], model | str):
            parsed = ready[1]
        if parsed is None:
            parsed = memo.get(value)
            if parsed is None:
                record, problem = parse_record(model, value, key=key, node=node)
                parsed = record if record is not None else problem.reason if problem is not None else "unreadable"
            seen[value] = parsed
        if isinstance(parsed, str):
            return None, UnreadableRecord(key=key, node=node, what=WHAT.get(key.split("/", 1)[0], "record"), reason=parsed)
        return parsed, None

    def _preparse(self, key: str, value: bytes) -> NodeRecord | NodeState | str | None:
        """A fact or a state as the view receives it (`RegistryView.parsed`):
        the model, or why it does not parse; None for any other key."""
        kind, _, node = key.partition("/")
        model = NodeRecord if kind == "facts" else NodeState if kind == "state" else None
        if model is None or not node or "/" in node:
            return None
        record, problem = parse_record(model, value, key=key, node=node)
        return record if record is not None else problem.reason if problem is not None else "unreadable"

    async def _informed_read(
        self, c: _Client, with_plan: bool = True
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], dict[bytes, tuple[bytes, Any]]]:
        """What `_read_live` reads, from the view when it is caught up with
        etcd's current revision; else a full read, which starts a new view
        (registry_etcd_view). A read without the plan (a host's own state) is
        a plain one: only the leader keeps a view."""
        base = self._prefix.encode() + b"/"
        if not with_plan:
            pairs, beats, _ = await _read_live(c, base, with_plan=False)
            return pairs, beats, {}
        view = self._view
        if view is not None and view.usable():
            if await view.caught_up(await _current_revision(c, self._key("epoch"))):
                self.view_reads += 1
                return view.snapshot()
        if view is not None:
            self._view = None
            await view.stop()
        pairs, beats, revision = await _read_live(c, base)
        self.full_reads += 1
        if self._informer:
            trusted = progress_is_trusted(await _server_version(c))
            view = self._view = RegistryView(base, pairs, beats, revision, self._preparse, progress_trusted=trusted)
            view.task = asyncio.get_running_loop().create_task(view.follow(c.channel, c.metadata))
        return pairs, beats, {}

    def _read(self, with_plan: bool = True) -> LiveRead:
        now = from_epoch_seconds(self._now())
        pairs, beats, ready = self._call(lambda c: self._informed_read(c, with_plan), "reading the live state")
        read = self._parse_pairs(pairs, ready)
        problems = read.problems
        plan = self._plan_of(read.index_bytes, read.plan_parts, problems) if read.index_bytes is not None and with_plan else None
        alive = self._alive(beats, read.facts, now, problems)
        return LiveRead(
            now=now,
            records=read.facts,
            alive=alive,
            states=self._joined_states(read.stored, read.facts),
            drains=read.drains,
            plan=plan,
            leader=read.leader,
            epoch=read.epoch,
            concurrency=read.concurrency,
            problems=tuple(problems),
        )

    def _joined_states(self, stored: dict[str, NodeState], facts: dict[str, NodeRecord]) -> dict[str, NodeState]:
        """Each stored state with its node's facts (a state is stored without
        them: `stored_state`), joined once: the same stored state and record
        (parsed once per value: `_parse_pairs`) give the same state again."""
        states: dict[str, NodeState] = {}
        joined: dict[str, tuple[NodeState, NodeRecord | None, NodeState]] = {}
        before = self._joined
        for node, state in stored.items():
            record = facts.get(node)
            held = before.get(node)
            if held is not None and held[0] is state and held[1] is record:
                states[node] = held[2]
            else:
                states[node] = with_facts(state, record)
            joined[node] = (state, record, states[node])
        self._joined = joined
        return states

    def _parse_pairs(self, pairs: list[tuple[bytes, bytes]], ready: dict[bytes, tuple[bytes, Any]]) -> _Parsed:
        """Every value parsed on its own: one that does not parse or validate
        is skipped and named (a host may write anything into its own keys);
        its node then counts as not beating. A fact or a state whose key holds
        the very value of the last read (the view keeps a value until it
        changes) is taken as the last read parsed it; between two leader
        steps most other values are the same bytes (the states this leader
        wrote, the facts of silent nodes): they are parsed once too."""
        out = _Parsed()
        seen_records: dict[bytes, NodeRecord | str] = {}
        seen_states: dict[bytes, NodeState | str] = {}
        known, fresh = self._by_key, {}
        for raw, value in pairs:
            held = known.get(raw)
            if held is not None and held[0] is value:
                fresh[raw] = held
                out.take(*held[1:])
                continue
            key = key_text(raw)
            parts = key.split("/")
            kind = parts[0]
            node = parts[1] if len(parts) == 2 else ""
            problem: UnreadableRecord | None = None
            if kind == "facts" and node:
                record, problem = self._parsed(self._record_memo, seen_records, value, NodeRecord, key=key, node=node, ready=ready.get(raw))
                # A host may write only its own keys; a record naming another
                # host under them is not believed.
                if record is not None and record.node_id != node:
                    record, problem = None, UnreadableRecord(key=key, node=node, what=WHAT[kind], reason=f"names another host ({record.node_id})")
                fresh[raw] = (value, kind, node, record, problem)
                out.take(kind, node, record, problem)
            elif kind == "state" and node:
                state, problem = self._parsed(self._state_memo, seen_states, value, NodeState, key=key, node=node, ready=ready.get(raw))
                fresh[raw] = (value, kind, node, state, problem)
                out.take(kind, node, state, problem)
            else:
                out.other(key, kind, node, value)
        self._record_memo, self._state_memo, self._by_key = seen_records, seen_states, fresh
        return out

    def _plan_of(self, index_bytes: bytes, parts: dict[str, bytes], problems: list[UnreadableRecord]) -> FleetPlan | None:
        """The plan of the index read (its parts from the same revision), put
        together once per index: the same index bytes, the same plan."""
        memo = self._plan_memo
        if memo is not None and memo[0] == index_bytes:
            return memo[1]
        plan, problem = read_plan(index_bytes, parts.get, where=f"etcd {self._key(PLAN_INDEX).decode()}")
        if problem is not None:
            problems.append(problem)
        self._plan_memo = (index_bytes, plan) if plan is not None else None
        return plan

    def _alive(self, beats: Sequence[bytes], facts: dict[str, NodeRecord], now: datetime, problems: list[UnreadableRecord]) -> frozenset[str]:
        """The nodes whose beat is live (`beats`: the keys under P/nodes/),
        their records in `facts` (a live beat without facts: read from its
        beat; one that does not parse goes to `problems`)."""
        alive = {key_text(node) for node in beats if b"/" not in node}
        # The lease is the liveness, and etcd revokes an expired lease up to
        # its lessor's check interval (500 ms) late: a beat whose own expiry
        # (beat_at, stamped just before the lease was granted or refreshed,
        # + its TTL) has passed is lapsed already, so the leader marks the
        # node offline at its lapse, not half a second after it.
        # Each record's expiry is computed once (the same record object: the same expiry).
        expiries: dict[str, tuple[NodeRecord, datetime | None]] = {}
        before, now = self._expiries, utc(now)
        for node in alive:
            record = facts.get(node)
            if record is not None:
                held = before.get(node)
                expiries[node] = held if held is not None and held[0] is record else (record, beat_expiry(record))
        self._expiries = expiries
        alive -= {node for node, (_, expiry) in expiries.items() if expiry is not None and now >= expiry}
        # A beat writes nodes/ and facts/ in one transaction with the same
        # value, so the facts are the live record. Only when the leader
        # dropped a dead node's facts as it beat again is a live beat without
        # facts: its record is read from its beat.
        missing = sorted(alive - set(facts))
        if missing:
            for node, (record, problem) in zip(missing, self._beats_of(missing), strict=True):
                if record is not None and record.node_id == node:
                    facts[node] = record
                elif problem is not None:
                    problems.append(problem)
        return frozenset(alive)

    def _beats_of(self, nodes: Sequence[str]) -> list[tuple[NodeRecord | None, UnreadableRecord | None]]:
        """The live beats of `nodes` (P/nodes/<node>), each parsed on its own."""
        keys = [self._key("nodes", n) for n in nodes]

        async def op(c: _Client) -> list[bytes | None]:
            found = [await c.get(key) for key in keys]
            return [kv.value if kv is not None else None for kv in found]

        values = self._call(op, "reading live beats")
        return [
            parse_record(NodeRecord, value, key=f"nodes/{node}", node=node) if value is not None else (None, None)
            for node, value in zip(nodes, values, strict=True)
        ]

    def _store_lifecycle(self, leadership: Leadership, changed: dict[str, NodeState], dead: set[str], forgotten: set[str]) -> None:
        """The changed states and deletions in chunks (`lifecycle_chunks`),
        each one transaction fenced by the leader key; with nothing to write,
        one empty fenced transaction (the check that the term still holds).
        A fence failing at any chunk raises NotLeader and no chunk is sent
        after it (those already in flight beside it are fenced each)."""
        # What a state's key holds: the state without what its facts hold.
        forms = {n: stored_state(s) for n, s in changed.items()}
        writes: list[tuple[str, bytes, bytes | None]] = [
            ("put", self._key("state", n), form.model_dump_json().encode()) for n, form in sorted(forms.items())
        ]
        writes += [("delete", self._key("facts", n), None) for n in sorted(dead | forgotten)]
        for n in sorted(forgotten):
            writes += [("delete", self._key("state", n), None), ("delete", self._key("drain", n), None)]
        chunks = lifecycle_chunks(writes)
        over = f"{leadership.candidate}'s term of epoch {leadership.epoch} is over"

        async def store(c: _Client, chunk: list[tuple[str, bytes, bytes | None]], fence_held: asyncio.Event) -> None:
            if fence_held.is_set():
                tx = c.transactions
                ops = [tx.put(key, value) if kind == "put" else tx.delete(key) for kind, key, value in chunk]
                ok, _ = await c.transaction(compare=self._fence(c, leadership), success=ops, failure=[])
                if not ok:
                    fence_held.clear()

        async def op(c: _Client) -> None:
            # Up to TXN_IN_FLIGHT chunks at once, a new one sent as soon as
            # one is answered (not in lockstep batches): etcd commits
            # concurrent requests together, so 10,000 states take a few
            # commits, not 80. Each chunk is still its own fenced transaction;
            # once a fence fails no chunk is sent any more.
            fence_held = asyncio.Event()
            fence_held.set()
            pending = iter(chunks)

            async def sender() -> None:
                for chunk in pending:
                    if not fence_held.is_set():
                        return
                    await store(c, chunk, fence_held)

            await asyncio.gather(*(sender() for _ in range(min(TXN_IN_FLIGHT, len(chunks)))))
            if not fence_held.is_set():
                raise NotLeader(over)

        self._call(op, f"storing {leadership.candidate}'s lifecycle ({len(chunks)} transactions)")
        # The next read finds these bytes again: it need not parse them.
        for kind, _key, value in writes:
            if kind == "put" and value is not None:
                name = _key.decode().rsplit("/", 1)[1]
                self._state_memo[value] = forms[name]

    # -- auth: users, roles and the switch (fabric registry init-auth) ----------------------
    # aetcd 1.0 has no auth API: these call etcd's Auth service on the client's channel.

    @staticmethod
    async def _auth_rpc(c: _Client, method: str, request):
        await c.connect()
        try:
            return await getattr(rpc.AuthStub(c.channel), method)(request, timeout=c._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise aetcd.ConnectionFailedError(exc.details()) from exc
            raise aetcd.ClientError(exc.details()) from exc

    async def _auth_enabled(self, c: _Client) -> bool:
        # etcd 3.5 answers AuthStatus; 3.4 does not know it, but refuses to
        # authenticate anyone with "authentication is not enabled" while auth is off.
        try:
            return bool((await self._auth_rpc(c, "AuthStatus", rpc.AuthStatusRequest())).enabled)
        except aetcd.ClientError as exc:
            if _status(exc) != grpc.StatusCode.UNIMPLEMENTED:
                raise
        try:
            await self._auth_rpc(c, "Authenticate", rpc.AuthenticateRequest(name="fabric-auth-probe", password=""))
        except aetcd.ClientError as exc:
            if _status(exc) == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in str(exc):
                return False
            if _status(exc) == grpc.StatusCode.INVALID_ARGUMENT:  # authentication failed: auth is on
                return True
            raise
        return True

    def access_state(self) -> AccessState:
        async def op(c: _Client) -> AccessState:
            roles: dict[str, frozenset[Grant]] = {}
            for role in (await self._auth_rpc(c, "RoleList", rpc.AuthRoleListRequest())).roles:
                perms = (await self._auth_rpc(c, "RoleGet", rpc.AuthRoleGetRequest(role=role))).perm
                roles[role] = frozenset(Grant(p.key.decode(), p.range_end.decode(), _ACCESS[p.permType]) for p in perms)
            users: dict[str, frozenset[str]] = {}
            for user in (await self._auth_rpc(c, "UserList", rpc.AuthUserListRequest())).users:
                users[user] = frozenset((await self._auth_rpc(c, "UserGet", rpc.AuthUserGetRequest(name=user))).roles)
            return AccessState(roles=roles, users=users, auth_enabled=await self._auth_enabled(c))

        return self._call(op, "reading users and roles")

    def apply_auth_step(self, step: AuthStep) -> None:
        grant = step.grant

        def permission() -> auth_pb2.Permission:
            assert grant is not None
            return auth_pb2.Permission(permType=_PERM_TYPE[grant.access], key=grant.key.encode(), range_end=grant.range_end.encode())

        requests = {
            "add_role": lambda: ("RoleAdd", rpc.AuthRoleAddRequest(name=step.name)),
            "grant_permission": lambda: ("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=step.name, perm=permission())),
            "revoke_permission": lambda: (
                "RoleRevokePermission",
                rpc.AuthRoleRevokePermissionRequest(role=step.name, key=grant.key.encode(), range_end=grant.range_end.encode()),
            ),
            # No password: only a certificate with this CN acts as the user.
            "add_user": lambda: ("UserAdd", rpc.AuthUserAddRequest(name=step.name, options=auth_pb2.UserAddOptions(no_password=True))),
            "grant_role": lambda: ("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=step.name, role=step.role)),
            "revoke_role": lambda: ("UserRevokeRole", rpc.AuthUserRevokeRoleRequest(name=step.name, role=step.role)),
            "enable_auth": lambda: ("AuthEnable", rpc.AuthEnableRequest()),
        }
        method, request = requests[step.kind]()

        async def op(c: _Client) -> None:
            await self._auth_rpc(c, method, request)

        self._call(op, f"the auth change '{step.describe()}'")

    # -- watching -------------------------------------------------------------------------

    def _is_membership_change(self, event) -> bool:
        key = event.kv.key[len(self._prefix) + 1 :].decode(errors="replace")
        kind = key.split("/", 1)[0]
        if kind == "nodes":
            # A join (first version of the key) or an expiry/removal; a
            # routine beat of a known node is not a change.
            return event.kind == "DELETE" or event.kv.version == 1
        if kind == "leader":
            # A new term, a resignation or the record gone; a renewal (which
            # rewrites renewed_at every third of the TTL) is not a change.
            return event.kind == "DELETE" or event.kv.version == 1 or b'"resigned":true' in event.kv.value
        if kind == "liveness":
            # A fast liveness record gone (its lease lapsed): the leader
            # looks at once (issue 30); a new record or a keep-alive is not a change.
            return event.kind == "DELETE"
        return kind == "drain"

    async def _watch_forever(self) -> None:
        base = self._prefix.encode() + b"/"
        while not self._closed:
            client = None
            try:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
                watch = await client.watch_prefix(base)
                try:
                    async for event in watch:
                        if self._is_membership_change(event):
                            self._changed.set()
                    # The watch ended without an error (its client was closed
                    # by a failed operation): changes may come before the
                    # next watch starts, so the caller reads again.
                    self._changed.set()
                finally:
                    try:
                        await asyncio.wait_for(watch.cancel(), 1)
                    except BaseException:
                        pass
            except asyncio.CancelledError:
                raise
            except Exception:
                # The endpoint went away: wake the caller (it re-reads) and
                # watch through the next endpoint.
                self._changed.set()
                if client is not None and self._client is client:  # not already switched by an operation
                    await self._drop_client()
                    self._current = (self._current + 1) % len(self._endpoints)
                await asyncio.sleep(0.2)

    def wait_for_change(self, timeout_s: float) -> bool:
        """The watch starts on the first call and runs until `close`; changes
        made between two calls are reported by the second."""
        if self._watch_task is None:

            async def start() -> asyncio.Task:
                return asyncio.get_running_loop().create_task(self._watch_forever())

            self._watch_task = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=5)
        changed = self._changed.wait(timeout_s)
        self._changed.clear()
        return changed

    # -- fabric watch -----------------------------------------------------------------------

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        """Served by a watch of the keys P/plan, P/drain/<host> and
        P/state/<host> on the loop thread, started on the first call from a
        read of the three at one revision (the baseline) and watching from the
        next revision, so nothing falls between the two. A version is the
        key's mod_revision. When the watch ends (the endpoint went away), the
        next call raises RegistryUnavailable and the one after starts again
        from a new read, through the next endpoint that answers."""
        check_node_id(host)
        if self._closed:
            raise RegistryError("registry is closed")
        follow = self._host_follow
        if follow is None or follow.host != host:
            if follow is not None and follow.task is not None:
                self._loop.call_soon_threadsafe(follow.task.cancel)
            follow = self._host_follow = _HostFollow(host)

            async def start() -> asyncio.Task:
                return asyncio.get_running_loop().create_task(self._follow_host(follow))

            follow.task = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=5)
        changes, failure = follow.take(timeout_s)
        if failure is not None:
            self._host_follow = None
            raise RegistryUnavailable(f"etcd: watching {host}'s entries: {failure}")
        return changes

    async def _follow_host(self, follow: _HostFollow) -> None:
        keys = {
            self._key(PLAN_INDEX): (PLAN, ""),
            self._key("drain", follow.host): (DRAIN, follow.host),
            self._key("state", follow.host): (STATE, follow.host),
        }
        watches: list = []
        client: _Client | None = None
        try:

            async def read(c: _Client) -> tuple[dict[bytes, str], int, _Client]:
                revision = 0
                found: dict[bytes, str] = {}
                for key in keys:
                    kvs, revision = await _read_range(c, key, key + b"\0", revision)
                    found[key] = str(kvs[0].mod_revision) if kvs else ""
                return found, revision, c

            found, revision, client = await self._with_failover(read)
            for key in keys:
                watches.append(await client.watch(key, start_revision=revision + 1))
            follow.put([EntryVersion(kind, node, found[key]) for key, (kind, node) in keys.items()])

            async def pump(key: bytes, watch) -> None:
                kind, node = keys[key]
                async for event in watch:
                    follow.put([EntryVersion(kind, node, "" if event.kind == "DELETE" else str(event.kv.mod_revision))])
                raise aetcd.ConnectionFailedError("the watch ended")

            await asyncio.gather(*(pump(key, watch) for key, watch in zip(keys, watches, strict=True)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            follow.fail(str(exc) or type(exc).__name__)
            if client is not None and self._client is client:  # not already switched by an operation
                await self._drop_client()
                self._current = (self._current + 1) % len(self._endpoints)
        finally:
            for watch in watches:
                try:
                    await asyncio.wait_for(watch.cancel(), 1)
                except BaseException:
                    pass
