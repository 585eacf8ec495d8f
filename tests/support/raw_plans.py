"""A plan written straight into a registry, as a raw writer (an attacker, a broken leader) would.

The registry stores a plan in parts (reconciler.core.live.plan_parts): its
index under P/plan-index and each part under P/plan-parts/<digest> (sqlite:
the tables plan_index and plan_parts). These write any `FleetPlan`, its
signature as it is (forged, copied, none), in that shape, bypassing the
adapter's fence: what a client with write access to those keys can do.
"""

from __future__ import annotations

import sqlite3

from reconciler.core.live.models import FleetPlan
from reconciler.core.live.plan_parts import plan_index, plan_parts


def plan_writes(prefix: str, plan: FleetPlan) -> list[tuple[bytes, bytes]]:
    """The etcd puts of `plan` under `prefix` (no trailing slash): each part, then the index."""
    named = plan_parts(plan)
    index = plan_index(plan, named)
    puts = [(f"{prefix}/plan-parts/{index.parts[name]}".encode(), data) for name, data in named.items()]
    return [*puts, (f"{prefix}/plan-index".encode(), index.model_dump_json().encode())]


async def put_plan(client, prefix: str, plan: FleetPlan) -> None:  # type: ignore[no-untyped-def]
    """`plan_writes` through an aetcd client."""
    for key, value in plan_writes(prefix, plan):
        await client.put(key, value)


def write_sqlite_plan(db: sqlite3.Connection, plan: FleetPlan, *, epoch: int | None = None) -> None:
    """`plan` into a sqlite registry's tables (its row's epoch `epoch`, default the plan's)."""
    named = plan_parts(plan)
    index = plan_index(plan, named)
    db.executemany("INSERT OR REPLACE INTO plan_parts (digest, part) VALUES (?, ?)", [(index.parts[n], d) for n, d in named.items()])
    db.execute(
        "INSERT INTO plan_index (id, epoch, plan_index) VALUES (1, ?, ?) ON CONFLICT(id) DO UPDATE SET epoch = excluded.epoch, plan_index = excluded.plan_index",
        (plan.epoch if epoch is None else epoch, index.model_dump_json()),
    )
