"""The leader's in-memory view of the etcd registry, kept from a watch (an
informer, as Kubernetes' client keeps one): one full read, then the changes.

`EtcdRegistry._read` used to read every key under the prefix at every leader
step (at 10,000 nodes, most of a steady step). Now the first read is a full
read at a revision R (`_read_live`, the same keys: no lane jobs, no members, no pending
reports, only the keys of the live beats) and a watch of the prefix from R + 1
applies every change to the view: a put sets the value, a delete (a lease
that expired, a dropped record) removes it.

A read from the view is a read at the registry's current revision, never an
older one: it asks etcd's current revision (one small range request) and
waits until the view has applied every change up to it. The events under the
prefix carry their revision and one watch receives them in revision order, so
an event at or past that revision proves every earlier one arrived. When the
newest writes were elsewhere in etcd no event comes: a progress request (the
watch is created with progress_notify) makes etcd say "this watch has sent
everything up to revision N". Only an etcd whose progress answers keep to the
stream's order is asked (`progress_is_trusted`: 3.4.31, 3.5.13 and later, the
versions Kubernetes requires before it serves consistent reads from its watch
cache). Before those fixes (etcd issues 15220 and 17507) etcd could answer a
progress request out of band, with the current revision, while the events
before it were still queued: a view then "caught up" without them and served
an older state (a leader saw a node's drain and its own stored state vanish;
Debian 12 ships 3.4.23). Against such an etcd the view catches up by events
only, and when none comes for `QUIET_S` (the writes were outside the prefix)
the read is a full one. So a leader always reads its own writes and
everything before them, as from a full read.

A view is dropped, and the next read is a full read that starts a new one,
when: the watch ends or fails (the endpoint went away, the client was dropped
by a failover), etcd compacted the revision it watches from, etcd cancelled it,
the view does not catch up within `CATCH_UP_S`, or it is older than
`RESYNC_S` (a full read now and then, as informers resync: a safety net
against any event lost).

Values are kept as bytes; the facts and the states are parsed as they arrive
(on the registry's loop thread, between steps), so a step finds most of them
parsed: `parsed` maps a key to (value, model or the reason it does not parse).
Nothing else changes for the reader: every value is still parsed on its own,
and one that does not parse is skipped and named (`parse_record`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aetcd import rpc, utils

# How long a read waits for the view to reach etcd's current revision before
# it drops the view and reads whole instead.
CATCH_UP_S = 2.0
# A progress request is repeated this often while waiting (etcd answers one
# only when the watch has sent every event up to its revision).
PROGRESS_EVERY_S = 0.1
# A view older than this is dropped: the next read is a full one.
RESYNC_S = 300.0
# Without trusted progress answers, a view still behind that received nothing
# for this long gives up: the writes it misses were outside the prefix (or the
# watch is slow), and the read is a full one.
QUIET_S = 0.25
# The first etcd release of each line whose requested progress notifications
# keep to the watch stream's order (etcd PRs 15237 and 17557, backported).
PROGRESS_FIXED = {(3, 4): (3, 4, 31), (3, 5): (3, 5, 13)}

Parse = Callable[[str, bytes], Any]


def progress_is_trusted(version: str | None) -> bool:
    """Whether an etcd server of `version` ("3.5.13", as its Status answers)
    answers a progress request only once its watch sent every event before
    the revision it names. Unknown or unparsable: no."""
    if not version:
        return False
    try:
        numbers = tuple(int(part) for part in version.split("-", 1)[0].split(".")[:3])
    except ValueError:
        return False
    if len(numbers) != 3:
        return False
    fixed = PROGRESS_FIXED.get(numbers[:2])
    if fixed is not None:
        return numbers >= fixed
    return numbers[:2] > (3, 5)


class ViewBroken(Exception):
    """The watch behind a view ended: the view may be stale."""


class RegistryView:
    """Keys under `base` as of `revision` (see the module's docstring); lives on
    the registry's event loop, and only that loop touches it."""

    def __init__(
        self, base: bytes, pairs: list[tuple[bytes, bytes]], beats: list[bytes], revision: int, parse: Parse, *, progress_trusted: bool = False
    ) -> None:
        self.base = base
        # Whether etcd's progress answers may move `revision` (`progress_is_trusted`).
        self.progress_trusted = progress_trusted
        self.values: dict[bytes, bytes] = dict(pairs)
        self.beats: set[bytes] = set(beats)
        self.revision = revision
        self.parsed: dict[bytes, tuple[bytes, Any]] = {}
        self.failure: str | None = None
        self.started = time.monotonic()
        self.task: asyncio.Task | None = None
        self.events = 0
        self._parse = parse
        self._moved = asyncio.Event()
        self._requests: asyncio.Queue[rpc.WatchRequest | None] = asyncio.Queue()
        self._skip = tuple(base + k for k in (b"jobs/", b"members/", b"pending/"))
        self._nodes = base + b"nodes/"

    # -- the watch ------------------------------------------------------------------

    async def _outgoing(self) -> AsyncIterator[rpc.WatchRequest]:
        while True:
            request = await self._requests.get()
            if request is None:
                return
            yield request

    async def follow(self, channel: Any, metadata: Any) -> None:
        """Watch from revision + 1 until cancelled or broken (then `failure`
        says why and every waiting read gives up)."""
        create = rpc.WatchCreateRequest(
            key=self.base, range_end=utils.prefix_range_end(self.base), start_revision=self.revision + 1, progress_notify=True
        )
        self._requests.put_nowait(rpc.WatchRequest(create_request=create))
        try:
            async for reply in rpc.WatchStub(channel).Watch(self._outgoing(), metadata=metadata):
                if reply.compact_revision:
                    raise ViewBroken(f"etcd compacted revision {reply.compact_revision}, past the view's {self.revision}")
                if reply.canceled:
                    raise ViewBroken(f"etcd cancelled the watch: {reply.cancel_reason or 'no reason given'}")
                self.receive(reply)
            raise ViewBroken("the watch ended")
        except asyncio.CancelledError:
            self.failure = self.failure or "stopped"
            raise
        except Exception as exc:
            self.failure = str(exc) or type(exc).__name__
        finally:
            self._requests.put_nowait(None)
            self._moved.set()

    def receive(self, reply: Any) -> None:
        """One watch reply: its events applied; a progress notification moves
        the view's revision only when etcd's progress answers are trusted."""
        if reply.events:
            self.apply(reply.events)
        elif not reply.created and self.progress_trusted:
            # A progress notification: every event up to this revision was sent.
            self.revision = max(self.revision, reply.header.revision)
        self._moved.set()

    def apply(self, events: Any) -> None:
        """Each event in order: a put sets the key's value (a beat: its key
        only), a delete removes it; the view's revision is the newest event's."""
        for event in events:
            key = event.kv.key
            self.revision = max(self.revision, event.kv.mod_revision)
            self.events += 1
            if key.startswith(self._skip):
                continue
            deleted = event.type == rpc.Event.DELETE
            if key.startswith(self._nodes):
                node = key[len(self._nodes) :]
                if deleted:
                    self.beats.discard(node)
                else:
                    self.beats.add(node)
                continue
            name = key[len(self.base) :]
            if deleted:
                self.values.pop(name, None)
                self.parsed.pop(name, None)
            else:
                value = event.kv.value
                self.values[name] = value
                parsed = self._parse(name.decode(errors="replace"), value)
                if parsed is not None:
                    self.parsed[name] = (value, parsed)

    # -- reading ------------------------------------------------------------------

    def usable(self) -> bool:
        return self.failure is None and time.monotonic() - self.started < RESYNC_S

    async def caught_up(self, revision: int, wait_s: float = CATCH_UP_S) -> bool:
        """Whether the view reached `revision` within `wait_s` (asking etcd for
        progress while waiting, where its answers are trusted; else giving up
        once nothing arrived for `QUIET_S`); False when it did not or broke."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and self.revision < revision:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._moved.clear()
            if self.progress_trusted:
                self._requests.put_nowait(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
            try:
                await asyncio.wait_for(self._moved.wait(), min(left, PROGRESS_EVERY_S if self.progress_trusted else QUIET_S))
            except TimeoutError:
                if not self.progress_trusted:
                    return False
        return self.failure is None

    def snapshot(self) -> tuple[list[tuple[bytes, bytes]], list[bytes], dict[bytes, tuple[bytes, Any]]]:
        """(key, value) pairs with the base cut off, the live beats, and what is parsed already."""
        return list(self.values.items()), list(self.beats), dict(self.parsed)

    async def stop(self) -> None:
        task, self.task = self.task, None
        self.failure = self.failure or "stopped"
        if task is not None:
            task.cancel()
            try:
                await task
            except BaseException:
                pass
