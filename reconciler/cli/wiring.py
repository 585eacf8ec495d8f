"""Open the registry fabric.toml's [registry] names. Only `reconciler.cli` calls this.

    registry = open_registry(desired.fleet)                    # as configured
    registry = open_registry(desired.fleet, sqlite_path=PATH)   # --registry-path / $FABRIC_REGISTRY

`sqlite_path` forces the sqlite backend at that file whatever [registry]
says (tests and the demo run a fleet on one machine without etcd).
"""

from __future__ import annotations

from pathlib import Path

from reconciler.core.desired.model import FleetConfig
from reconciler.ports import Clock, Registry


def open_registry(
    fleet: FleetConfig,
    *,
    clock: Clock | None = None,
    sqlite_path: str | Path | None = None,
    op_timeout_s: float = 3.0,
) -> Registry:
    """The configured backend, connected lazily (etcd) or opened (sqlite).

    Raises `RegistryUnavailable` when a sqlite file cannot be opened; an etcd
    cluster is only contacted by the first call."""
    from reconciler.adapters.clock import SystemClock

    clock = clock or SystemClock()
    settings = fleet.registry
    if sqlite_path is not None or settings.backend == "sqlite":
        from reconciler.adapters.registry_sqlite import SqliteRegistry

        return SqliteRegistry(sqlite_path or settings.path, timing=fleet.timing, flap=fleet.flap, clock=clock)

    from reconciler.adapters.registry_etcd import EtcdRegistry

    return EtcdRegistry(
        list(settings.endpoints),
        prefix=settings.prefix,
        timing=fleet.timing,
        flap=fleet.flap,
        clock=clock,
        ca_file=settings.ca_file,
        cert_file=settings.cert_file,
        key_file=settings.key_file,
        op_timeout_s=op_timeout_s,
    )
