"""The rendered Ray units for real: `systemd-analyze verify` of both, and a
worker that systemd starts joins a head.

The example fleet's `[ray]` (head lux, workers qfox-1, a1-arm64, x86-spill),
rendered from the replayed probes of lux and qfox-1 with Ray 2.60 from this
venv (the `ray` extra, which scripts/test installs). In a systemd container
with its own network namespace (both hosts' tailnet addresses on its
loopback), systemd activates the rendered `fabric-ray-head.service` (lux) and
`fabric-ray-worker.service` (qfox-1) exactly as written, hardening and
dynamic users included; a driver inside the container then waits until the
head lists the worker's node with the resources and labels the fabric
rendered for it. Both units are stopped through systemd, and the container
by its PID (the harness).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import Artifact, Layout, render
from reconciler.core.render.ray_node import HOST_LABEL, RAY_HEAD_UNIT, RAY_WORKER_UNIT
from reconciler.ports import ActivationError
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.systemd import SystemdContainer, systemd_container
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

PROBES = REPO / "tests" / "fixtures" / "probe"
GOLDEN_PLAN = REPO / "tests" / "golden" / "fleet-plan.json"
# How long one Ray node takes to start and register on this machine
# (shared/notes/real-components.md: three nodes in 13.5 s).
RAY_NODE_START_S = 15.0
# Where this venv's site-packages are copied into the container when the
# units cannot see them in place (under /tmp, hidden by their PrivateTmp=).
CONTAINER_SITE = "/opt/fabric-ray/site-packages"
# The `ray` program the units run in the container: Ray's own entry point.
RAY_WRAPPER = "/usr/local/bin/fabric-test-ray"


def ray_program() -> Path:
    """This venv's `ray` (the `ray` extra); its absence fails, never skips."""
    program = Path(sys.prefix) / "bin" / "ray"
    if not program.exists():
        pytest.fail(f"real component missing: {program} (the `ray` extra; scripts/test installs it)")
    return program


def probe(machine: str) -> HostFacts:
    return HostFacts.model_validate(json.loads((PROBES / machine / "expected.json").read_text()))


def ray_artifact(desired: DesiredState, host: str, ray: str) -> Artifact:
    plan = FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())
    rendered = render(desired, host, probe(host), plan, layout=Layout(ray=ray))
    return next(a for a in rendered.artifacts if a.unit in (RAY_HEAD_UNIT, RAY_WORKER_UNIT))


def test_both_rendered_ray_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    require_root()
    require("systemd-analyze")
    ray = str(ray_program())
    desired = load_desired(EXAMPLE_FLEET)
    verifier = SystemdAnalyzeVerifier(SubprocessRunner())
    paths = []
    for host, unit in (("lux", RAY_HEAD_UNIT), ("qfox-1", RAY_WORKER_UNIT)):
        artifact = ray_artifact(desired, host, ray)
        assert artifact.unit == unit
        path = tmp_path / host / unit
        path.parent.mkdir()
        path.write_text(artifact.content)
        paths.append(str(path))
        verifier.verify([str(path)])
    # The check reads these units: a misspelled hardening key in the worker fails it.
    worker = Path(paths[1])
    worker.write_text(worker.read_text().replace("ProtectKernelLogs=yes", "ProtectKernelLog=yes"))
    with pytest.raises(ActivationError, match=RAY_WORKER_UNIT):
        verifier.verify([str(worker)])


def visible_ray(container: SystemdContainer) -> tuple[str, tuple[str, ...]]:
    """(ray program, python argv) that the container's units can run, both
    Ray 2.60 from this venv: the distribution's python of the venv's version
    with the venv's site-packages on PYTHONPATH (a venv's own interpreter
    may live under /root, which ProtectHome= hides, as pyenv's does), the
    site-packages copied into the container when they are under /tmp
    (hidden by PrivateTmp=). Ray's processes inherit PYTHONPATH."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)))
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not container.host_path(python).exists():
        pytest.fail(f"real component missing: {python} (the units run Ray with the distribution's python of this venv's version)")
    if site.is_relative_to("/tmp"):
        shutil.copytree(site, container.host_path(CONTAINER_SITE), symlinks=True)
        site = Path(CONTAINER_SITE)
    container.write_file(
        RAY_WRAPPER,
        f"#!/bin/sh\nexport PYTHONPATH={site} PYTHONDONTWRITEBYTECODE=1\n"
        f"exec {python} -c 'import sys; from ray.scripts.scripts import main; sys.exit(main())' \"$@\"\n",
        mode=0o755,
    )
    return RAY_WRAPPER, ("env", f"PYTHONPATH={site}", "PYTHONDONTWRITEBYTECODE=1", python)


@pytest.fixture
def ray_container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot", "ip")
    ray_program()
    with systemd_container(hostname="fabric-ray", private_network=True) as container:
        # lux's and qfox-1's replayed probes found their render nodes owned by
        # `render`, so their Ray units join it (SupplementaryGroups=); a real
        # GPU host has that group (udev's), this machine's /etc may not.
        if container.run("getent", "group", "render").returncode != 0:
            assert container.run("groupadd", "--system", "render").returncode == 0
        yield container


# Runs inside the container: a driver on the head's node asks the head for
# its nodes until the worker of `host` is alive, then prints what Ray reports.
NODES_OF_HOST = """
import json, sys, time
import ray
head, node_ip, host_label, host, timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
ray.init(address=head, _node_ip_address=node_ip, log_to_driver=False, logging_level="ERROR")
deadline = time.monotonic() + timeout
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    mine = [n for n in nodes if n.get("Labels", {}).get(host_label) == host]
    if mine or time.monotonic() > deadline:
        print(json.dumps({"alive": len(nodes), "node": mine[0] if mine else None}))
        break
    time.sleep(0.5)
ray.shutdown()
"""


def test_a_rendered_ray_worker_activated_by_systemd_joins_the_rendered_head(ray_container: SystemdContainer) -> None:
    container = ray_container
    ray, python = visible_ray(container)
    desired = load_desired(EXAMPLE_FLEET)
    assert desired.fleet.ray is not None and desired.fleet.ray.head == "lux" and "qfox-1" in desired.fleet.ray.workers
    head_address = desired.hosts["lux"].host.address
    worker_address = desired.hosts["qfox-1"].host.address
    for argv in (("ip", "link", "set", "lo", "up"), *(("ip", "addr", "add", f"{a}/32", "dev", "lo") for a in (head_address, worker_address))):
        done = container.run(*argv)
        assert done.returncode == 0, done.stderr
    head = ray_artifact(desired, "lux", ray)
    worker = ray_artifact(desired, "qfox-1", ray)
    for artifact in (head, worker):
        container.write_file(f"/etc/systemd/system/{artifact.unit}", artifact.content)
    assert container.systemctl("daemon-reload").returncode == 0
    timeout = deadline_for(RAY_NODE_START_S, at_least=60.0)
    try:
        for unit in (RAY_HEAD_UNIT, RAY_WORKER_UNIT):
            started = container.systemctl("start", unit)
            assert started.returncode == 0, started.stderr + container.journal("-u", unit)
        found = container.run(
            *python,
            "-c",
            NODES_OF_HOST,
            f"{head_address}:{desired.fleet.ray.port}",
            head_address,
            HOST_LABEL,
            "qfox-1",
            str(timeout),
            timeout=timeout + 60.0,
        )
        assert found.returncode == 0, found.stderr[-4000:] + container.journal("-u", RAY_WORKER_UNIT)[-4000:]
        seen = json.loads(found.stdout.strip().splitlines()[-1])
        node = seen["node"]
        assert node is not None, f"the head never listed qfox-1's node: {seen}\n" + container.journal("-u", RAY_WORKER_UNIT)[-4000:]
        assert seen["alive"] == 2
        # What the unit rendered is what the head knows of the node.
        assert node["NodeManagerAddress"] == worker_address
        spec_line = next(line for line in worker.content.splitlines() if line.startswith("ExecStart="))
        resources = json.loads(
            next(w for w in spec_line.split('" "') if w.startswith("--resources=")).removeprefix("--resources=").replace('\\"', '"')
        )
        assert resources["tier_gpu_cuda"] == 4.0
        for name, amount in resources.items():
            assert node["Resources"][name] == amount
        assert node["Resources"]["CPU"] == 4.0
        assert node["Resources"]["GPU"] == 1.0  # the RTX 4070 alone: its AMD iGPU is no CUDA device
        labels = node["Labels"]
        assert labels[HOST_LABEL] == "qfox-1"
        assert labels["topology.researchstack.io/tier"] == "gpu_cuda"
        assert labels["topology.researchstack.io/gpu"] == "nvidia-rtx4070"
        assert labels["topology.researchstack.io/arch"] == "x86_64"
        # systemd runs it, as the dynamic user the unit names.
        shown = container.systemctl("show", "--property=ActiveState,DynamicUser", RAY_WORKER_UNIT)
        assert "ActiveState=active" in shown.stdout and "DynamicUser=yes" in shown.stdout
    finally:
        for unit in (RAY_WORKER_UNIT, RAY_HEAD_UNIT):
            container.systemctl("stop", unit, timeout=120.0)
    assert wait_until(
        lambda: container.systemctl("is-active", RAY_WORKER_UNIT).stdout.strip() in ("inactive", "failed"),
        timeout=timeout,
        what="the worker unit to stop",
    )
