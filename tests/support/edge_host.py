"""The edge host "racknerd" of the example fleet in a systemd container, as
the tests of whole activated passes set it up (test_reconcile_activation,
test_reconcile_memo, test_crash_consistency).

The passes run inside the container (`python3 -m reconciler`, the package
from the checkout and its dependencies copied from this venv), exactly as
fabric-reconcile.service would run them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import annotated_types
import dbus_fast
import jinja2
import markupsafe
import prometheus_client
import pydantic
import pydantic_core
import typing_extensions
import typing_inspection

from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.systemd import SystemdContainer, systemd_container

SITE = "/opt/fabric-test/site"
DESIRED = "/var/lib/fabric/desired"
# qfox-1's tailnet address, put on the container's loopback with an echo
# server on its port 22, so the port map qfox-ssh (2222 -> qfox-1:22)
# carries real traffic.
QFOX_ADDRESS = "100.88.57.96"
QFOX_ECHO_UNIT = f"[Service]\nExecStart=/usr/bin/socat TCP-LISTEN:22,bind={QFOX_ADDRESS},fork,reuseaddr EXEC:/bin/cat\n"
REPLAYED_PROBE = REPO / "tests" / "golden" / "probe" / "x86_64"
FLEET_PLAN = REPO / "tests" / "golden" / "fleet-plan.json"


def copy_dependencies(container: SystemdContainer) -> None:
    """The reconciler's runtime dependencies, from this venv into the container
    (its /tmp, where the venv lives, is the container's own)."""
    target = container.host_path(SITE)
    target.mkdir(parents=True)
    for module in (pydantic, pydantic_core, jinja2, markupsafe, dbus_fast, annotated_types, typing_inspection, prometheus_client):
        source = Path(module.__file__).parent  # type: ignore[arg-type]
        shutil.copytree(source, target / source.name)
    shutil.copy(typing_extensions.__file__, target)  # type: ignore[arg-type]


@contextmanager
def edge_container(*programs: str) -> Iterator[SystemdContainer]:
    """racknerd's container (its own network namespace) with the package's
    dependencies and the example fleet's desired state in place; `programs`
    are what the test needs beyond the passes' own."""
    require_root()
    require("unshare", "nsenter", "chroot", "python3", "nft", "socat", "caddy", "ip", *programs)
    with systemd_container(hostname="racknerd", private_network=True) as container:
        copy_dependencies(container)
        for toml in sorted(EXAMPLE_FLEET.glob("*.toml")):
            container.write_file(f"{DESIRED}/{toml.name}", toml.read_text())
        yield container


def reconcile_argv(plan_file: str | Path = FLEET_PLAN, *options: str) -> list[str]:
    """`fabric reconcile` of racknerd inside the container (a replayed probe
    of an x86_64 box, the fleet plan from a file), run through `env`."""
    return [
        "env",
        f"PYTHONPATH={SITE}:{REPO}",
        "PYTHONDONTWRITEBYTECODE=1",
        "python3",
        "-m",
        "reconciler",
        "reconcile",
        "--desired",
        DESIRED,
        "--host",
        "racknerd",
        "--replay",
        str(REPLAYED_PROBE),
        "--plan-file",
        str(plan_file),
        *options,
    ]


def reconcile(container: SystemdContainer) -> subprocess.CompletedProcess[str]:
    """One `fabric reconcile` of racknerd inside the container (reconcile_argv's)."""
    return container.run(*reconcile_argv(), timeout=300)


def invocation(container: SystemdContainer, unit: str) -> str:
    return container.systemctl("show", unit, "-p", "InvocationID", "--value").stdout.strip()


def echo_through(container: SystemdContainer, port: int) -> str:
    done = container.run("socat", "-T", "2", "-", f"TCP:127.0.0.1:{port}", input="ping\n", timeout=30)
    return done.stdout.strip()
