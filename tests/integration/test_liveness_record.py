"""fabric-watch's fast liveness record (issue 30) on real registries.

The whole `fabric watch` runs as a process against a real etcd (its D-Bus
address points nowhere: it never gets to start a pass, and needs none to
keep its record alive). Its record appears on a short lease; SIGKILL the
watcher and the lease lapses within [timing] liveness_ttl_s, etcd deletes
the key, and a leader waiting on the registry's watch wakes. On both
backends the record is kept alive and read back the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.suspicion import LivenessRecord
from reconciler.ports import Registry
from tests.conftest import REPO
from tests.support.harness.etcd import EtcdCluster
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

INTERVAL_S = 1
TTL_S = 3


def liveness_of(registry: Registry, host: str) -> LivenessRecord | None:
    return next((r for r in registry.liveness() if r.host == host), None)


def test_a_kept_record_is_read_back_with_its_expiry(store: Store) -> None:
    registry = store.open()
    before = datetime.now(UTC)
    kept = registry.keep_alive("lux", TTL_S)
    assert kept.host == "lux" and kept.ttl_s == TTL_S
    again = registry.keep_alive("lux", TTL_S)  # etcd: the same lease kept alive
    seen = liveness_of(store.open(), "lux")
    assert seen is not None and seen.host == "lux"
    assert before < seen.expires_at, "alive now"
    assert (seen.expires_at - before).total_seconds() <= TTL_S + 1, f"lapses within its TTL: {seen} after {again}"
    with pytest.raises(ValueError):
        registry.keep_alive("../lux", TTL_S)


def desired_with_short_liveness(store: Store, tmp_path: Path) -> Path:
    directory = store.desired_dir(tmp_path / "desired")
    toml = directory / "fabric.toml"
    text = toml.read_text()
    assert "[timing]\n" in text
    toml.write_text(text.replace("[timing]\n", f"[timing]\nliveness_s = {INTERVAL_S}\nliveness_ttl_s = {TTL_S}\n", 1))
    return directory


@pytest.fixture
def etcd_store(etcd: EtcdCluster, tmp_path: Path):
    settings = {"backend": "etcd", "endpoints": etcd.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}
    store = Store("etcd", settings, None)
    yield store
    store.close()


def test_the_lease_lapses_when_the_watcher_is_killed_and_the_leaders_watch_wakes(etcd_store: Store, tmp_path: Path) -> None:
    desired = desired_with_short_liveness(etcd_store, tmp_path)
    leader_side = etcd_store.open()
    leader_side.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg"), ttl_s=300)
    leader_side.wait_for_change(0)  # the watch armed
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "reconciler", "watch", "--desired", str(desired), "--host", "lux"]
    argv += ["--state-dir", str(tmp_path / "state"), "--systemd-bus", f"unix:path={tmp_path / 'no-bus'}"]
    watcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = wait_until(lambda: liveness_of(leader_side, "lux"), timeout=deadline_for(TTL_S, at_least=30), what="lux's liveness record")
        # Kept alive past its first TTL: the watcher keeps it, not the first put.
        wait_until(
            lambda: (r := liveness_of(leader_side, "lux")) is not None and r.expires_at > first.expires_at,
            timeout=deadline_for(TTL_S),
            what="the record kept alive",
        )
        leader_side.wait_for_change(0)  # forget what happened so far
        watcher.kill()
        watcher.wait(timeout=10)
        wait_until(lambda: liveness_of(leader_side, "lux") is None, timeout=deadline_for(TTL_S), what="the record gone with its lease")
        assert leader_side.wait_for_change(deadline_for(TTL_S)), "the deletion woke the leader's watch"
        assert "lux" in {s.node_id for s in leader_side.node_states() if s.status == "active"}, "the node timeout has not passed"
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)
        if watcher.stderr is not None:
            watcher.stderr.close()
