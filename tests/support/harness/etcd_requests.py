"""What the etcd registry sends: every KV request's size and every transaction's operation count.

Usage::

    with recording_requests() as seen:
        ... EtcdRegistry calls ...
    assert seen.largest_txn_ops <= 128 and seen.largest_request_bytes <= 1.5 * 2**20

It wraps the KV stub of every `reconciler.adapters.registry_etcd._Client`
connected inside the block (Range, Put, DeleteRange, Txn), so the figures are
the protobuf requests as they go to etcd. The wrapper is removed on exit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from reconciler.adapters import registry_etcd


@dataclass
class SeenRequests:
    count: int = 0
    transactions: int = 0
    # etcd's --max-txn-ops counts the longest of compare, success and failure.
    largest_txn_ops: int = 0
    largest_txn_compares_plus_writes: int = 0
    largest_request_bytes: int = 0
    largest_request: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        """Forget what was seen so far (to measure one phase)."""
        with self._lock:
            self.count = self.transactions = self.largest_txn_ops = self.largest_txn_compares_plus_writes = self.largest_request_bytes = 0
            self.largest_request = ""

    def note(self, method: str, request) -> None:
        size = request.ByteSize()
        with self._lock:
            self.count += 1
            if method == "Txn":
                self.transactions += 1
                ops = max(len(request.compare), len(request.success), len(request.failure))
                self.largest_txn_ops = max(self.largest_txn_ops, ops)
                self.largest_txn_compares_plus_writes = max(self.largest_txn_compares_plus_writes, len(request.compare) + len(request.success))
            if size > self.largest_request_bytes:
                self.largest_request_bytes, self.largest_request = size, method


class _RecordingStub:
    def __init__(self, stub, seen: SeenRequests) -> None:
        self._stub, self._seen = stub, seen

    def __getattr__(self, method: str):
        call = getattr(self._stub, method)

        def recorded(request, *args, **kwargs):
            self._seen.note(method, request)
            return call(request, *args, **kwargs)

        return recorded


@contextmanager
def recording_requests() -> Iterator[SeenRequests]:
    seen = SeenRequests()
    original = registry_etcd._Client.connect

    async def connect(self) -> None:
        await original(self)
        if not isinstance(self.kvstub, _RecordingStub):
            self.kvstub = _RecordingStub(self.kvstub, seen)

    registry_etcd._Client.connect = connect  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        registry_etcd._Client.connect = original  # type: ignore[method-assign]
