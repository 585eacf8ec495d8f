"""Run inside a fleet container: what this host's own etcd identity may write.

    /usr/bin/python3 identity_probe.py DESIRED_DIR OTHER

Opens the registry of DESIRED_DIR's fabric.toml with its [registry]
certificate (the container's own, CN = its host name) and tries what a
compromised host would: a heartbeat in OTHER's name, and a plan put straight
under the plan's keys (leader OTHER, a higher epoch). Prints one JSON object:
each attempt -> "ok" or the error's message. (Its own heartbeat is what its
passes send all along.)

Runs under the container's system python3 with the bind-mounted checkout and
packages, as the /opt/fabric/bin/fabric launcher does (tests/e2e/fleet.py).
"""

from __future__ import annotations

import json
import site
import sys

PREFIX = "/opt/fabric"
before = list(sys.path)
site.addsitedir(f"{PREFIX}/site-packages")
sys.path[:] = [f"{PREFIX}/src"] + [p for p in sys.path if p not in before] + before

from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

from reconciler.core.desired.load import load_desired  # noqa: E402
from reconciler.core.live.models import FleetPlan  # noqa: E402
from reconciler.core.live.plan_parts import plan_index, plan_parts  # noqa: E402
from reconciler.core.live.records import NodeRecord  # noqa: E402
from reconciler.wiring import open_registry  # noqa: E402


def main(desired_dir: str, other: str) -> int:
    fleet = load_desired(Path(desired_dir)).fleet
    registry = open_registry(fleet)
    prefix = fleet.registry.prefix.rstrip("/")
    results: dict[str, str] = {}

    def attempt(name: str, action) -> None:
        try:
            action()
            results[name] = "ok"
        except Exception as exc:  # the message is the result
            results[name] = f"{type(exc).__name__}: {exc}"

    def put_plan() -> None:
        forged = FleetPlan(epoch=registry.epoch() + 1, leader=other, created=datetime.now(UTC))

        async def op(client) -> None:
            # The plan in parts (reconciler.core.live.plan_parts): each part, then the index.
            named = plan_parts(forged)
            index = plan_index(forged, named)
            for name, data in named.items():
                await client.put(f"{prefix}/plan-parts/{index.parts[name]}".encode(), data)
            await client.put(f"{prefix}/plan-index".encode(), index.model_dump_json().encode())

        registry._call(op, f"a put of {prefix}/plan-parts and {prefix}/plan-index")

    try:
        attempt(f"heartbeat of {other}", lambda: registry.heartbeat(NodeRecord(node_id=other, tier="gpu_cuda")))
        attempt("plan", put_plan)
    finally:
        registry.close()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
