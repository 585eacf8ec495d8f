"""The leader's etcd view trusts a progress answer only from an etcd whose
answers keep to the watch stream's order (registry_etcd_view).

etcd before 3.4.31 / 3.5.13 could answer a requested progress notification
out of band with its current revision while the events before it were still
queued for the watch (etcd issues 15220 and 17507). A view that believed it
"caught up" without them: a leader's read missed its own stored state and a
drain set just before (test_registry_parity's drain test, once, on Debian's
3.4.23). The replies here are etcd's own protobuf messages, fed to the view in
the order that etcd sent them.
"""

from __future__ import annotations

import asyncio

import pytest
from aetcd import rpc

from reconciler.adapters.registry_etcd_view import RegistryView, progress_is_trusted

BASE = b"/fabric/"


@pytest.mark.parametrize(
    ("version", "trusted"),
    [
        ("3.4.23", False),  # Debian 12's: the bug
        ("3.4.30", False),
        ("3.4.31", True),
        ("3.5.12", False),
        ("3.5.13", True),
        ("3.5.21", True),
        ("3.6.0", True),
        ("3.6.0-rc.2", True),
        ("3.3.27", False),
        ("", False),
        (None, False),
        ("garbage", False),
        ("3.5", False),
    ],
)
def test_only_the_fixed_etcd_releases_are_trusted_with_progress(version, trusted):
    assert progress_is_trusted(version) is trusted


def put(key: bytes, value: bytes, revision: int) -> rpc.WatchResponse:
    kv = rpc.KeyValue(key=BASE + key, value=value, mod_revision=revision, create_revision=revision)
    return rpc.WatchResponse(header=rpc.ResponseHeader(revision=revision), events=[rpc.Event(type=rpc.Event.PUT, kv=kv)])


def progress(revision: int) -> rpc.WatchResponse:
    return rpc.WatchResponse(header=rpc.ResponseHeader(revision=revision))


def view_at(revision: int, *, trusted: bool) -> RegistryView:
    return RegistryView(BASE, [(b"facts/qfox-1", b"{}")], [b"qfox-1"], revision, lambda key, value: None, progress_trusted=trusted)


def test_an_untrusted_progress_answer_ahead_of_the_queued_events_does_not_catch_the_view_up():
    async def scenario() -> tuple[bool, bool, dict]:
        view = view_at(10, trusted=False)
        # etcd 3.4.23's order: the progress answer (revision 12) overtakes the
        # events of revisions 11 and 12 (the leader's stored state, a drain).
        view.receive(progress(12))
        early = await view.caught_up(12, wait_s=0.5)
        view.receive(put(b"state/qfox-1", b'{"status": "active"}', 11))
        view.receive(put(b"drain/qfox-1", b'{"reason": "kernel update"}', 12))
        late = await view.caught_up(12, wait_s=0.5)
        return early, late, dict(view.snapshot()[0])

    early, late, values = asyncio.run(scenario())
    assert not early, "a progress answer from an untrusted etcd moved the view past events it never received"
    assert late, "the events themselves catch the view up"
    assert values[b"drain/qfox-1"] == b'{"reason": "kernel update"}' and b"state/qfox-1" in values


def test_a_trusted_progress_answer_catches_a_view_up_when_the_writes_were_elsewhere():
    async def scenario() -> bool:
        view = view_at(10, trusted=True)
        view.receive(progress(15))  # revisions 11-15 were outside the prefix
        return await view.caught_up(15, wait_s=0.5)

    assert asyncio.run(scenario())


def test_an_untrusted_view_that_nothing_reaches_gives_up_for_a_full_read():
    async def scenario() -> bool:
        view = view_at(10, trusted=False)
        return await view.caught_up(15, wait_s=30)

    # The writes past 10 were outside the prefix: no event will ever come; the
    # read gives up after QUIET_S (not the 30 s allowed) and is a full one.
    assert asyncio.run(scenario()) is False
