"""Fixtures shared by the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.ports import Clock
from tests.conftest import require
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.harness.postgres import PostgresServer, postgres_server
from tests.support.registry_store import Store


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    """One real etcd member for the whole test module, stopped by PID after it."""
    require("etcd")
    with etcd_cluster(members=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def broker() -> Iterator[PostgresServer]:
    """phaze's broker: one real PostgreSQL for the whole session (each test
    takes a database of its own, `broker_dsn`), stopped by PID after it."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def broker_dsn(broker: PostgresServer) -> str:
    """A fresh database on the broker, for one test's lane queue and SAQ workers."""
    return broker.database(f"t{uuid.uuid4().hex[:16]}")


@pytest.fixture
def store_clock() -> Clock | None:
    """The clock `store` opens registries with; a module overrides this
    fixture with a FakeClock to move time by hand."""
    return None


@pytest.fixture(params=["sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path, store_clock: Clock | None) -> Iterator[Store]:
    """Each test twice: on a sqlite file and on a private prefix of the module's etcd."""
    if request.param == "etcd":
        cluster = request.getfixturevalue("etcd")
        settings = {"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}
        s = Store("etcd", settings, None, store_clock)
    else:
        path = str(tmp_path / "registry.sqlite")
        s = Store("sqlite", {"backend": "sqlite", "path": path}, path, store_clock)
    try:
        yield s
    finally:
        s.close()
