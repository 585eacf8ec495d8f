"""Signed fleet plans against a real etcd: a forged plan keeps every host on its generation.

The example fleet (with throwaway plan keys, tests.support.plan_keys) over one real
etcd member. Each host's pass is a real `run_pass` with the command line's
own ports (`reconciler.wiring.real_pass_ports`: files under a tmp root, the etcd
registry of fabric.toml, its replayed probe capture; --no-activate), only
the audit and the notes kept in lists. The leader is a real `LeaderLoop`
step with lux's key file.

  1 every host heartbeats; lux (a real LeaderLoop step) publishes a signed plan; every host applies it
  2 a plain etcd client writes a plan: valid JSON, a higher epoch, leader "lux", no signature
     -> every host refuses it, keeps its generation, and says why (pass output, audit `static`)
  3 the same with a signature by a key not listed for lux (qfox-1's, and a stranger's under lux's key id)
  4 lux's next step replaces the forged plan with a signed one, and every host applies that
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from urllib.parse import urlparse

import aetcd
import pytest

from reconciler.adapters.files import LocalTree
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.signing import canonical_plan, with_signature
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.apply import GenerationStore
from reconciler.engine.leader import LeaderLoop
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.reconcile import PassOptions, PassReport, run_pass
from reconciler.wiring import open_registry, plan_signer, real_pass_ports
from tests.conftest import REPO
from tests.support.audit import RecordingAudit
from tests.support.plan_keys import TestKey
from tests.support.raw_plans import put_plan
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

HOSTS = ("lux", "qfox-1", "racknerd", "a1-arm64", "x86-spill")
PROBES = REPO / "tests" / "fixtures" / "probe"


@dataclasses.dataclass
class HostPass:
    report: PassReport
    notes: list[str]
    audit: list[dict[str, str]]
    generation: int | None
    epoch: int | None


class EtcdFleet:
    def __init__(self, cluster, tmp: Path) -> None:
        self.store = Store("etcd", {"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None)
        self.desired = self.store.desired_dir(tmp)
        self.signed = self.store.signed
        self.tmp = tmp
        self.fleet = load_desired(self.desired)

    def run_pass(self, host: str, *, key_file: Path | None = None) -> HostPass:
        """One real pass of `host`; candidates get no usable key unless given (so they do not lead)."""
        root = self.tmp / "roots" / host
        root.mkdir(parents=True, exist_ok=True)
        options = PassOptions(
            desired=self.desired,
            host=host,
            root=root,
            replay=str(PROBES / host),
            plan=PlanFromRegistry(),
            no_activate=True,
            plan_key_file=key_file or self.tmp / "no-such.key",
        )
        notes: list[str] = []
        audit = RecordingAudit()
        with real_pass_ports(options) as ports:
            ports.note = notes.append
            ports.audit = audit
            report = run_pass(options, ports)
        store = GenerationStore(LocalTree(root))
        current = store.current()
        manifest = store.manifest(current)
        return HostPass(report, notes, audit.records, current, manifest.epoch if manifest else None)

    def every_pass(self) -> dict[str, HostPass]:
        return {host: self.run_pass(host) for host in HOSTS}

    def lead(self, host: str = "lux") -> FleetPlan:
        """One real LeaderLoop step of `host` with its key file, then resign."""
        registry = open_registry(self.fleet.fleet)
        log: list[str] = []
        try:
            LeaderLoop(
                registry=registry,
                host=host,
                load_desired=lambda: load_desired(self.desired),
                schedule=schedule,
                lease_ttl_s=10,
                log=log.append,
                signer=plan_signer(self.signed.key_file(host)),
            ).step_and_resign()
            plan = registry.newest_plan()
        finally:
            registry.close()
        assert plan is not None and plan.leader == host, log
        return plan

    def newest(self) -> FleetPlan | None:
        registry = open_registry(self.fleet.fleet)
        try:
            return registry.newest_plan()
        finally:
            registry.close()

    def write_raw_plan(self, plan: FleetPlan) -> None:
        """What any etcd client can do: put JSON under the plan key (and raise the epoch key to match)."""
        endpoint = urlparse(self.store.settings["endpoints"][0])
        prefix = self.store.settings["prefix"]

        async def put() -> None:
            async with aetcd.Client(host=endpoint.hostname or "127.0.0.1", port=endpoint.port or 2379) as client:
                await client.put(f"{prefix}/epoch".encode(), str(plan.epoch).encode())
                await put_plan(client, prefix, plan)

        asyncio.run(put())


@pytest.fixture
def fleet(etcd, tmp_path) -> EtcdFleet:
    return EtcdFleet(etcd, tmp_path)


def assert_refused_everywhere(fleet: EtcdFleet, before: dict[str, HostPass], why: str) -> None:
    for host in HOSTS:
        after = fleet.run_pass(host)
        report = after.report
        assert report.outcome == "static", (host, report)
        assert why in report.stdout and "running static" in report.stdout, (host, report.stdout)
        assert report.stdout.endswith(f"; generation {before[host].generation} stays\n"), (host, report.stdout)
        assert (after.generation, after.epoch) == (before[host].generation, before[host].epoch), host
        static = [r for r in after.audit if r["action"] == "static"]
        assert len(static) == 1 and why in static[0]["reason"], (host, after.audit)


def test_forged_plans_are_refused_by_every_host_and_a_signed_one_is_applied(fleet) -> None:
    # 1 Heartbeats (the candidates hold no key here, so no pass leads), then lux signs and publishes.
    first = fleet.every_pass()
    assert all(p.report.ok for p in first.values()), first
    assert any("cannot sign plans, so it does not lead" in n for n in first["lux"].notes), first["lux"].notes
    assert fleet.newest() is None
    signed = fleet.lead("lux")
    assert signed.signature is not None and signed.signature.key_id == "lux-test"
    applied = fleet.every_pass()
    for host, result in applied.items():
        assert result.report.ok and result.report.outcome != "static", (host, result.report)
        assert f"plan epoch {signed.epoch} is newer than 0" in result.notes, (host, result.notes)
        # A host whose files the plan changes installs a generation recording its epoch.
        assert result.epoch == signed.epoch or result.report.outcome == "noop", (host, result)
    assert ("lupine", "qfox-1") in {(p.service, p.node) for p in signed.placements}
    assert applied["qfox-1"].epoch == signed.epoch and applied["qfox-1"].generation == 2

    # 2 A plain etcd client: valid JSON, a higher epoch, leader lux, lupine moved to racknerd, unsigned.
    moved = [p.model_copy(update={"node": "racknerd"}) if p.service == "lupine" else p for p in signed.placements]
    forged = signed.model_copy(update={"epoch": signed.epoch + 5, "placements": moved, "signature": None})
    fleet.write_raw_plan(forged)
    assert fleet.newest() == forged
    assert_refused_everywhere(fleet, applied, f"refused: plan epoch {forged.epoch} is not signed, and fabric.toml lists plan keys")

    # 3 Signed, but not by a key listed for lux: qfox-1's key, and a stranger's under lux's key id.
    by_qfox = fleet.signed.keys["qfox-1"]
    forged_by_qfox = with_signature(forged, by_qfox.id, by_qfox.private.sign(canonical_plan(forged)))
    fleet.write_raw_plan(forged_by_qfox)
    assert_refused_everywhere(fleet, applied, "names 'lux' as leader but is signed by 'qfox-1''s key 'qfox-1-test'")
    stranger = TestKey("lux", "lux-test")
    forged_under_lux_id = with_signature(forged, "lux-test", stranger.private.sign(canonical_plan(forged)))
    fleet.write_raw_plan(forged_under_lux_id)
    assert_refused_everywhere(fleet, applied, "does not match its content under 'lux''s key 'lux-test'")

    # 4 lux's next step sees a newest plan that does not verify and publishes a signed one.
    healed = fleet.lead("lux")
    assert healed.epoch > forged.epoch and healed.signature is not None
    assert {(p.service, p.node) for p in healed.placements} == {(p.service, p.node) for p in signed.placements}
    for host in HOSTS:
        result = fleet.run_pass(host)
        assert result.report.ok and result.report.outcome != "static", (host, result.report)
        assert f"plan epoch {healed.epoch} is newer than {applied[host].epoch}" in result.notes, (host, result.notes)


def test_a_valid_signature_copied_onto_changed_placements_is_refused(fleet) -> None:
    """A writer who copies a valid signature onto changed placements gains nothing."""
    fleet.every_pass()
    signed = fleet.lead("lux")
    applied = fleet.every_pass()
    tampered = signed.model_copy(
        update={"epoch": signed.epoch + 1, "placements": [Placement(service="lupine", replica=0, node="racknerd", tier="gpu_cuda")]}
    )
    fleet.write_raw_plan(tampered)
    assert_refused_everywhere(fleet, applied, "does not match its content")
