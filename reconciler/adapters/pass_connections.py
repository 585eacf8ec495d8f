"""The connections of one pass process: each opened once, shared by every user, closed once at the end.

A `fabric reconcile` process reaches the registry up to four times (the
memo's epoch check and beat, the full pass's first beat and plan read, its
beat after activation, the edge's fleet view) and phaze's broker (the lane
queue) about as often. Each user used to open its own connection: an etcd
client is a thread, a gRPC channel and a TLS handshake, the broker a
PostgreSQL session, all on the CPU that the passes of a new plan share.

`PassConnections.kept(key, open)` keeps one connection per key (the backend
and the settings it is opened with; wiring.py makes the keys) and hands
each user a `Kept` handle on it. The engine closes what it opened, as
before: a handle's close() leaves the connection to the next user, and
`PassConnections.close()`, when the pass process ends, closes each once.

A connection that a call failed through (any exception) is not handed out
again: the next user opens a new one, as every user did before, and the
failed one is closed when the user whose call failed closes its handle. An
etcd client recovers by itself from an endpoint that stops answering (the
next call tries the endpoints afresh), a PostgreSQL session is dropped on an
operational error and opened again; but what a failure leaves behind (a
request timed out on the etcd client's loop, a sqlite file locked past its
busy timeout, a half-read reply) is not for the next user to inherit. So a
pass that sees the registry fail fails static exactly as it did when every
use had its own connection.

Standard library only: a memoized pass opens its registry and lane queue
through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")


class PassConnections:
    """The connections a pass process opened, by key (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] = {}  # key -> the connection handed out for it
        self._opened: list[Any] = []  # every connection opened, in order
        self._retired: set[int] = set()  # ids of connections a call failed through
        self._closed: set[int] = set()

    def kept(self, key: str, open_connection: Callable[[Any | None], T]) -> T:
        """A handle on the connection kept under `key`. `open_connection` is
        called with the connection kept there (None: none yet, or the last one
        failed) and returns it, to share it, or a new connection (it may build
        it on the kept one: the full pass's sqlite registry on the memo's file),
        kept from then on. What `open_connection` raises is raised here, and
        nothing is kept."""
        previous = self._kept.get(key)
        connection = open_connection(previous)
        if connection is not previous:
            self._opened.append(connection)
            self._kept[key] = connection
        return cast(T, Kept(self, key, connection))

    def close(self) -> None:
        """Close every connection not closed yet, the last opened first; the
        first error is raised once all were tried."""
        self._kept.clear()
        failure: Exception | None = None
        for connection in reversed(self._opened):
            try:
                self._close(connection)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _retire(self, key: str, connection: Any) -> None:
        if self._kept.get(key) is connection:
            del self._kept[key]
        self._retired.add(id(connection))

    def _release(self, connection: Any) -> None:
        if id(connection) in self._retired:
            self._close(connection)

    def _close(self, connection: Any) -> None:
        if id(connection) not in self._closed:
            self._closed.add(id(connection))
            connection.close()


class Kept:
    """One user's handle on a kept connection: every attribute is the
    connection's, every call goes to it; close() leaves it open for the next
    user, unless a call through this handle failed."""

    def __init__(self, owner: PassConnections, key: str, connection: Any) -> None:
        self._owner = owner
        self._key = key
        self._connection = connection

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._connection, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except BaseException:
                self._owner._retire(self._key, self._connection)
                raise

        return call

    def close(self) -> None:
        self._owner._release(self._connection)
