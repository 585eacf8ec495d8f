"""The example fleet's lanes as the fabric's own (no [phaze] api_url): the
rank/cap dispatcher's tests run on it, since the example fleet itself is a
phaze fleet, where phaze dispatches and the fabric writes no job.

Its compute lanes' queues are <agent.queue_prefix><agent_ref> with the
fabric's default prefix; the local lane's stays LOCAL_QUEUE."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.conftest import EXAMPLE_FLEET

OWN_A1, OWN_X86, OWN_LOCAL = "fabric-lane-a1-arm64", "fabric-lane-x86-spill", "phaze-local"

_API_URL = re.compile(r"(?m)^api_url = .*\n")


def own_lanes(fabric_toml: str) -> str:
    """fabric.toml's text without [phaze] api_url: the lanes are the fabric's own."""
    assert _API_URL.search(fabric_toml), "the example fleet names phaze's agent API"
    return _API_URL.sub("", fabric_toml, count=1)


def own_lanes_fleet(target: Path) -> Path:
    """A copy of the example fleet at `target` whose lanes are the fabric's own."""
    shutil.copytree(EXAMPLE_FLEET, target)
    toml = target / "fabric.toml"
    toml.write_text(own_lanes(toml.read_text()))
    return target
