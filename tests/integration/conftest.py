"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import require
from tests.harness.etcd import EtcdCluster, etcd_cluster


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    """One real etcd member for the whole test module, stopped by PID after it."""
    require("etcd")
    with etcd_cluster(members=1) as cluster:
        yield cluster
