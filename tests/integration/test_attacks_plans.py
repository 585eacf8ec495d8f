"""Attacks on the plan and the leader record, each with exactly the identity that could make it.

A real etcd member with TLS and auth on (tests/support/harness/etcd.py, `fabric
registry init-auth` through the CLI, every identity its own client
certificate, CN = host), the example fleet with throwaway plan keys
(tests.plan_keys), each test under a prefix of its own. Hosts run real passes
(`run_pass` with the command line's own ports, a replayed probe capture,
--no-activate) with their own certificates; leaders are real `LeaderLoop`s
with their key files, or a real `fabric leader run` process.

  a listed candidate that does not lead (qfox-1's certificate and plan key)
      signs a plan naming itself, in the current term, with epoch 10^15:
      refused (the registry names lux), and lux's next plan is applied
  a plan of another fleet signed by the same key (lux's key, listed by a
      second fleet), copied in by a candidate's certificate: refused for its
      fleet name, and for its registry prefix
  a plan of an earlier term, replayed (lux's own genuine plan, written back by
      a candidate's certificate) after a host rolled back to a generation of
      that term, and to a host with no generation: refused, the next plan applied
  a plain host (x86-spill's certificate) keeps a killed leader's lease alive:
      a candidate takes the stale record over within one TTL + 0.5 s of its
      last renewal, and its plan is applied
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.adapters.files import LocalTree
from reconciler.cli import EXIT_OK, main
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import LeaderInfo
from reconciler.core.live.signing import canonical_plan, with_signature
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.apply import GenerationStore
from reconciler.engine.leader import LeaderLoop
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.reconcile import PassOptions, PassReport, run_pass
from reconciler.ports import Registry
from reconciler.wiring import open_registry, plan_signer, real_pass_ports, system_clock
from tests.conftest import REPO, require
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.harness.waiting import deadline_for, stop_process, wait_until
from tests.support.plan_keys import SignedFleet, TestKey, signed_example_fleet
from tests.support.raw_plans import put_plan

pytestmark = pytest.mark.integration

HOSTS = ("lux", "qfox-1", "racknerd", "a1-arm64", "x86-spill")
PROBES = REPO / "tests" / "fixtures" / "probe"
HUGE_EPOCH = 10**15
# The example fleet's [registry] lines, replaced by each identity's etcd settings.
_EXAMPLE_REGISTRY = 'backend = "sqlite"        # embedded default; "etcd" for the fleet\npath = "/var/lib/fabric/registry.sqlite"'


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=1, tls=True) as c:
        yield c


@dataclasses.dataclass
class HostPass:
    report: PassReport
    notes: list[str]
    generation: int | None
    epoch: int | None
    term: int | None


class AttackFleet:
    """The signed example fleet on the TLS etcd under a prefix of its own;
    one desired directory per identity (its own certificate in [registry])."""

    def __init__(self, cluster: EtcdCluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.prefix = f"/atk{uuid.uuid4().hex[:10]}"
        self.signed: SignedFleet = signed_example_fleet(tmp / "signed")
        self.opened: list[Registry] = []
        self.clients: dict[str, Registry] = {}
        self.dirs: dict[str, Path] = {}
        status, out, err = self._cli("registry", "init-auth", "--desired", str(self.desired("root")))
        assert status == EXIT_OK, out + err

    @staticmethod
    def _cli(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(argv))
        return status, out.getvalue(), err.getvalue()

    def desired(self, identity: str) -> Path:
        """The desired state as the machine of `identity` has it."""
        if identity not in self.dirs:
            target = self.tmp / "as" / identity
            shutil.copytree(self.signed.desired, target)
            tls = self.cluster.tls_settings(identity)
            endpoints = ", ".join(f'"{e}"' for e in self.cluster.endpoints)
            block = (
                f'backend = "etcd"\nendpoints = [{endpoints}]\nprefix = "{self.prefix}"\n'
                f'ca_file = "{tls["ca_file"]}"\ncert_file = "{tls["cert_file"]}"\nkey_file = "{tls["key_file"]}"'
            )
            text = (target / "fabric.toml").read_text()
            assert _EXAMPLE_REGISTRY in text
            (target / "fabric.toml").write_text(text.replace(_EXAMPLE_REGISTRY, block))
            self.dirs[identity] = target
        return self.dirs[identity]

    def _open(self, identity: str) -> Registry:
        registry = open_registry(load_desired(self.desired(identity)).fleet)
        self.opened.append(registry)
        return registry

    def registry(self, identity: str) -> Registry:
        """`identity`'s registry client (one per identity, closed with the fleet)."""
        if identity not in self.clients:
            self.clients[identity] = self._open(identity)
        return self.clients[identity]

    def beat_all(self) -> None:
        """A pass of every host (none leads: no plan key), so the leader sees them alive."""
        for host in HOSTS:
            assert self.run_pass(host).report.ok, host

    def close(self) -> None:
        for registry in self.opened:
            registry.close()

    def leader(self, host: str, ttl_s: float = 60.0, log: list[str] | None = None) -> LeaderLoop:
        """A real LeaderLoop of candidate `host`: its certificate, its key file."""
        desired = self.desired(host)
        return LeaderLoop(
            registry=self._open(host),
            host=host,
            load_desired=lambda: load_desired(desired),
            schedule=schedule,
            lease_ttl_s=ttl_s,
            log=(log if log is not None else []).append,
            signer=plan_signer(self.signed.key_file(host)),
            clock=system_clock(),
        )

    def run_pass(self, host: str, root: Path | None = None) -> HostPass:
        """One real pass of `host` with its own certificate (no plan key: it does not lead)."""
        root = root or self.tmp / "roots" / host
        root.mkdir(parents=True, exist_ok=True)
        options = PassOptions(
            desired=self.desired(host),
            host=host,
            root=root,
            replay=str(PROBES / host),
            plan=PlanFromRegistry(),
            no_activate=True,
            plan_key_file=self.tmp / "no-such.key",
        )
        notes: list[str] = []
        with real_pass_ports(options) as ports:
            ports.note = notes.append
            report = run_pass(options, ports)
        store = GenerationStore(LocalTree(root))
        current = store.current()
        manifest = store.manifest(current)
        return HostPass(report, notes, current, manifest.epoch if manifest else None, manifest.term if manifest else None)

    def write_plan(self, identity: str, plan: FleetPlan, *, epoch: int | None = None) -> None:
        """What `identity`'s certificate lets it do: put a plan (and raise the epoch key)."""
        registry = self.registry(identity)

        async def put(c) -> None:  # type: ignore[no-untyped-def]
            if epoch is not None:
                await c.put(f"{self.prefix}/epoch".encode(), str(epoch).encode())
            await put_plan(c, self.prefix, plan)

        registry._call(put, "the attacker's plan")  # type: ignore[attr-defined]


@pytest.fixture
def fleet(cluster: EtcdCluster, tmp_path: Path) -> Iterator[AttackFleet]:
    f = AttackFleet(cluster, tmp_path)
    yield f
    f.close()


def sign(plan: FleetPlan, key: TestKey) -> FleetPlan:
    return with_signature(plan, key.id, key.private.sign(canonical_plan(plan)))


def assert_static(result: HostPass, before: HostPass, why: str) -> None:
    assert result.report.outcome == "static", result.report
    assert why in result.report.stdout and "running static" in result.report.stdout, result.report.stdout
    assert (result.generation, result.epoch, result.term) == (before.generation, before.epoch, before.term)


def assert_applied(result: HostPass, plan: FleetPlan) -> None:
    assert result.report.ok and result.report.outcome != "static", result.report
    assert any(note.startswith(f"plan epoch {plan.epoch} ") for note in result.notes), result.notes


# -- a candidate that does not lead -------------------------------------------------------------


def test_a_candidate_that_does_not_lead_cannot_apply_or_poison_with_a_huge_epoch(fleet: AttackFleet) -> None:
    fleet.beat_all()
    lux = fleet.leader("lux")
    lux.step()
    assert lux.leadership is not None
    genuine = fleet.registry("x86-spill").newest_plan()
    assert genuine is not None and genuine.leader == "lux" and genuine.term == lux.leadership.term
    applied = fleet.run_pass("a1-arm64")
    assert_applied(applied, genuine)
    assert (applied.epoch, applied.term) == (genuine.epoch, genuine.term) and applied.generation is not None

    # qfox-1 (its certificate may write the plan key; its own key signs): a plan
    # naming itself, in lux's current term, this fleet and prefix, that stops
    # what a1-arm64 runs, at epoch 10^15.
    evil = FleetPlan(
        epoch=HUGE_EPOCH,
        leader="qfox-1",
        term=lux.leadership.term,
        fleet=genuine.fleet,
        prefix=genuine.prefix,
        created=genuine.created,
        placements=[p for p in genuine.placements if p.node != "a1-arm64"],
        lanes=genuine.lanes,
    )
    fleet.write_plan("qfox-1", sign(evil, fleet.signed.keys["qfox-1"]), epoch=HUGE_EPOCH)
    refused = fleet.run_pass("a1-arm64")
    assert_static(refused, applied, "is signed by 'qfox-1', but the registry names 'lux' as leader")

    # lux's next step replaces the plan of a candidate that does not lead; the
    # epoch 10^15 it wrote does not stick: the next plan is applied.
    lux.step()
    healed = fleet.registry("x86-spill").newest_plan()
    assert healed is not None and healed.leader == "lux" and healed.term == lux.leadership.term and healed.epoch > HUGE_EPOCH
    after = fleet.run_pass("a1-arm64")
    assert_applied(after, healed)
    lux.step()  # and the one after it
    assert fleet.run_pass("a1-arm64").report.ok
    fleet.registry("lux").resign(lux.leadership)


# -- another fleet's plan ----------------------------------------------------------------------


def test_a_plan_of_another_fleet_signed_by_the_same_key_is_refused(fleet: AttackFleet) -> None:
    fleet.beat_all()
    lux = fleet.leader("lux")
    lux.step()
    assert lux.leadership is not None
    genuine = fleet.registry("racknerd").newest_plan()
    assert genuine is not None
    applied = fleet.run_pass("qfox-1")
    assert_applied(applied, genuine)
    lux_key = fleet.signed.keys["lux"]
    # A second fleet lists lux's key too: its leader signs its own plans with it
    # (another fleet's name, its registry prefix; in the worst case the same
    # term and a newer epoch), and qfox-1's certificate copies one in here.
    elsewhere = genuine.model_copy(update={"epoch": genuine.epoch + 1, "placements": [p for p in genuine.placements if p.node != "qfox-1"]})
    for changes, why in (
        ({"fleet": "otherfleet"}, "is signed for fleet 'otherfleet', not 'researchstack'"),
        ({"prefix": "/otherfleet"}, f"is signed for registry prefix '/otherfleet', not '{fleet.prefix}'"),
    ):
        fleet.write_plan("qfox-1", sign(elsewhere.model_copy(update=changes), lux_key), epoch=genuine.epoch + 1)
        assert_static(fleet.run_pass("qfox-1"), applied, why)
    lux.step()
    healed = fleet.registry("racknerd").newest_plan()
    assert healed is not None and healed.fleet == "researchstack" and healed.prefix == fleet.prefix
    assert_applied(fleet.run_pass("qfox-1"), healed)
    fleet.registry("lux").resign(lux.leadership)


# -- a replay of an earlier term ----------------------------------------------------------------


def test_a_plan_of_an_earlier_term_replayed_after_a_rollback_or_to_a_new_host_is_refused(fleet: AttackFleet) -> None:
    fleet.beat_all()
    lux = fleet.leader("lux")
    lux.step()
    assert lux.leadership is not None
    old = fleet.registry("racknerd").newest_plan()
    assert old is not None and ("lupine", "qfox-1") in {(p.service, p.node) for p in old.placements}
    first = fleet.run_pass("qfox-1")
    assert_applied(first, old)

    # A new term (lux again, after a resignation) whose plan moves qfox-1's work: qfox-1 drained by the operator.
    fleet.registry("fabric-admin").set_drain("qfox-1")
    fleet.registry("lux").resign(lux.leadership)
    # Resigned: nobody leads, and the record (its term) stays until the next campaign.
    resigned = fleet.registry("racknerd").leader_term()
    assert resigned is not None and resigned.resigned and resigned.term == old.term
    assert fleet.registry("racknerd").leader() is None and fleet.registry("racknerd").snapshot().leader is None
    lux.leadership = None
    lux.step()
    assert lux.leadership is not None and lux.leadership.term > old.term
    new = fleet.registry("racknerd").newest_plan()
    assert new is not None and new.term == lux.leadership.term
    assert ("lupine", "qfox-1") not in {(p.service, p.node) for p in new.placements}
    second = fleet.run_pass("qfox-1")
    assert_applied(second, new)
    assert second.generation is not None and first.generation is not None and second.generation > first.generation

    # qfox-1 rolls back to the generation of the earlier term (its fence now that term's) ...
    GenerationStore(LocalTree(fleet.tmp / "roots" / "qfox-1")).set_current(first.generation)
    rolled_back = HostPass(second.report, [], first.generation, first.epoch, first.term)
    # ... and a candidate's certificate writes lux's own genuine plan of that term back, epoch raised past the new one.
    fleet.write_plan("qfox-1", old, epoch=new.epoch + 1)
    assert_static(fleet.run_pass("qfox-1"), rolled_back, f"is of lux's term {old.term}, not the registry's current term {new.term}")
    # A host with no generation at all takes nothing from it either.
    fresh = fleet.run_pass("a1-arm64", root=fleet.tmp / "roots" / "a1-arm64-new")
    assert f"not the registry's current term {new.term}" in fresh.report.stdout + "\n".join(fresh.notes), (fresh.report, fresh.notes)
    assert fresh.term is None or fresh.term == 0, "the empty plan, not the replayed one"

    # The next legitimate plan (the leader's next step) is applied on both.
    lux.step()
    healed = fleet.registry("racknerd").newest_plan()
    assert healed is not None and healed.term == new.term and healed.epoch > new.epoch
    assert_applied(fleet.run_pass("qfox-1"), healed)
    assert_applied(fleet.run_pass("a1-arm64", root=fleet.tmp / "roots" / "a1-arm64-new"), healed)
    fleet.registry("fabric-admin").clear_drain("qfox-1")
    fleet.registry("lux").resign(lux.leadership)


# -- a kept-alive lease of a killed leader --------------------------------------------------------


def test_a_lease_kept_alive_by_a_host_does_not_keep_a_killed_leader_in_office(fleet: AttackFleet) -> None:
    ttl = 4.0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FABRIC_REGISTRY", None)
    reader = fleet.registry("racknerd")
    lux = subprocess.Popen(
        [sys.executable, "-m", "reconciler", "leader", "run", "--host", "lux", "--lease-ttl", str(ttl), "--desired", str(fleet.desired("lux"))]
        + ["--plan-key-file", str(fleet.signed.key_file("lux"))],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    attacker = fleet.registry("x86-spill")
    stop = threading.Event()
    kept: list[int] = []  # the TTL etcd answered to each of the attacker's keep-alives
    qfox_log: list[str] = []
    qfox = fleet.leader("qfox-1", ttl_s=ttl, log=qfox_log)
    follower = threading.Thread(target=qfox.run, name="qfox-1-leader", daemon=True)
    try:
        held = wait_until(lambda: (i := reader.leader()) is not None and i.candidate == "lux" and i, timeout=deadline_for(ttl), what="lux leads")
        assert isinstance(held, LeaderInfo)
        wait_until(lambda: (p := reader.newest_plan()) is not None and p.leader == "lux", timeout=deadline_for(ttl), what="lux's plan")
        lease = int(held.token)  # any host reads the lease id in the leader record

        def keep_alive() -> None:
            async def refresh(c) -> int:  # type: ignore[no-untyped-def]
                reply = await c.refresh_lease(lease)
                return int(reply.TTL) if reply is not None else -1

            while not stop.is_set():
                kept.append(attacker._call(refresh, "the attacker's keep-alive"))  # type: ignore[attr-defined]
                stop.wait(0.5)

        threading.Thread(target=keep_alive, name="attacker", daemon=True).start()
        wait_until(lambda: kept and kept[-1] > 0, timeout=deadline_for(ttl), what="x86-spill keeps lux's lease alive")
        follower.start()
        lux.send_signal(signal.SIGKILL)
        lux.wait(timeout=10)
        last = reader.leader_term()  # what lux wrote last: nothing writes it any more
        assert last is not None and last.candidate == "lux" and not last.resigned
        assert last.renewed_at is not None and last.ttl_s == ttl

        taken = wait_until(
            lambda: (i := reader.leader()) is not None and i.candidate == "qfox-1" and i, timeout=deadline_for(ttl), what="qfox-1 takes over"
        )
        assert isinstance(taken, LeaderInfo)
        # The lease lux's record lived on is still alive: only the record's own freshness ended the term.
        assert kept[-1] > 0 and attacker._call(lambda c: c.refresh_lease(lease), "keep-alive").TTL > 0  # type: ignore[attr-defined]
        # In order: taken over once the record went stale (never while lux renewed it), within one TTL + 0.5 s of lux's last renewal.
        stale_at = last.stale_at()
        assert stale_at is not None and taken.since >= stale_at
        assert (taken.since - last.renewed_at).total_seconds() <= ttl + 0.5, (last, taken)
        assert taken.term > last.term
        plan = wait_until(
            lambda: (p := reader.newest_plan()) is not None and p.leader == "qfox-1" and p, timeout=deadline_for(ttl), what="qfox-1's plan"
        )
        assert isinstance(plan, FleetPlan) and plan.term == taken.term
        assert_applied(fleet.run_pass("a1-arm64"), plan)
    finally:
        stop.set()
        stop_process(lux)
        qfox.stop()
        if follower.is_alive():
            follower.join(timeout=deadline_for(ttl))
