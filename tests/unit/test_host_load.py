"""The load a host reports (reconciler.core.live.host_load) and its limits bounded by the probe (core.live.host_limits): pure rules."""

from __future__ import annotations

import pytest

from reconciler.core.desired.model import HostConfig, Limitations
from reconciler.core.desired.problems import ProblemsError
from reconciler.core.live.host_limits import effective_limits, lowered_note
from reconciler.core.live.host_load import HostLoad, host_load, lane_jobs_running, service_units, services_running

SERVICE_UNITS = ("fabric-agent-flac-fft.service", "fabric-agent-lupine.service")


def test_in_flight_counts_the_running_service_units_and_the_lane_jobs_here() -> None:
    states = {
        "fabric-agent-flac-fft.service": "active",
        "fabric-agent-lupine.service": "failed",
        "fabric-agent-x86-spill.service": "active",  # the lane's agent: its jobs count, not the unit
        "fabric-nftables.service": "active",
    }
    load = host_load(SERVICE_UNITS, states, ["x86-spill"], {"x86-spill": 3, "a1-arm64": 2})
    assert load == HostLoad(services=1, lane_jobs=3)
    assert load.in_flight == 4


@pytest.mark.parametrize(
    ("state", "counted"),
    [("active", True), ("reloading", True), ("activating", False), ("deactivating", False), ("inactive", False), ("failed", False)],
)
def test_only_an_active_or_reloading_service_unit_counts(state: str, counted: bool) -> None:
    assert services_running(SERVICE_UNITS[:1], {SERVICE_UNITS[0]: state}) == int(counted)


def test_a_service_unit_systemd_did_not_report_does_not_count() -> None:
    assert services_running(SERVICE_UNITS, {}) == 0


def test_without_activation_every_placement_the_host_runs_counts() -> None:
    assert services_running(SERVICE_UNITS, None) == 2
    assert host_load(SERVICE_UNITS, None, [], {}).in_flight == 2


def test_lane_jobs_count_only_on_the_lanes_whose_agent_runs_here_and_once_each() -> None:
    in_flight = {"x86-spill": 3, "a1-arm64": 2, "local": 1}
    assert lane_jobs_running([], in_flight) == 0
    assert lane_jobs_running(["a1-arm64"], in_flight) == 2
    assert lane_jobs_running(["a1-arm64", "a1-arm64", "local"], in_flight) == 3
    assert lane_jobs_running(["gone"], in_flight) == 0


def test_other_engines_tasks_join_the_same_account() -> None:
    assert HostLoad(services=1, lane_jobs=2, engine_tasks=3).in_flight == 6


def test_the_placed_service_units_are_picked_from_a_generations_units() -> None:
    units = ["fabric-nftables.service", "fabric-agent-x86-spill.service", "fabric-agent-lupine.service", "fabric-agent-flac-fft.service"]
    assert service_units(units, SERVICE_UNITS + ("fabric-agent-braid.service",)) == SERVICE_UNITS


# --------------------------------------------------------------------------
# Limits


def host(limits: dict[str, int], **overrides: object) -> HostConfig:
    return HostConfig.model_validate({"host": {"name": "x86-spill", "address": "100.101.7.22"}, "limits": limits, "overrides": overrides})


PROBED = Limitations(max_concurrent_tasks=2, max_concurrent_ceiling=3)


def test_a_declared_limit_above_the_probe_is_lowered_to_it_and_says_so() -> None:
    limits = effective_limits(host({"max_concurrent_tasks": 4, "max_concurrent_ceiling": 8}), PROBED)
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling) == (2, 3)
    assert limits.lowered == ("max_concurrent_tasks 4 lowered to 2 by the probe", "max_concurrent_ceiling 8 lowered to 3 by the probe")
    assert lowered_note(limits.lowered) == (
        "limits bounded by the probe: max_concurrent_tasks 4 lowered to 2 by the probe; "
        "max_concurrent_ceiling 8 lowered to 3 by the probe (overrides.limits_above_probe = true keeps the declared ones)"
    )


def test_a_declared_limit_at_or_below_the_probe_stands_and_an_undeclared_one_is_the_probes() -> None:
    limits = effective_limits(host({"max_concurrent_tasks": 1}), PROBED)
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling, limits.lowered) == (1, 3, ())
    limits = effective_limits(host({"max_concurrent_tasks": 2, "max_concurrent_ceiling": 3}), PROBED)
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling, limits.lowered) == (2, 3, ())
    assert effective_limits(host({}), PROBED) == effective_limits(host({}, limits_above_probe=True), PROBED)
    assert lowered_note(()) is None


def test_limits_above_probe_keeps_the_declared_limits() -> None:
    limits = effective_limits(host({"max_concurrent_tasks": 4, "max_concurrent_ceiling": 8}, limits_above_probe=True), PROBED)
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling, limits.lowered) == (4, 8, ())


def test_limits_above_probe_is_validated_like_the_other_override_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from reconciler.core.desired.load import load_desired
    from tests.conftest import EXAMPLE_FLEET

    desired = tmp_path / "desired"
    desired.mkdir()
    for f in EXAMPLE_FLEET.glob("*.toml"):
        (desired / f.name).write_text(f.read_text())
    spill = desired / "x86-spill.toml"
    good = spill.read_text()
    spill.write_text(good + "\n[overrides]\nlimits_above_probe = true\n")
    assert load_desired(desired).hosts["x86-spill"].overrides.limits_above_probe is True
    for bad, said in (
        ('limits_above_probe = "yes"', "overrides.limits_above_probe: Input should be a valid boolean"),
        ("limits_above_prob = true", "overrides.limits_above_prob: unknown key; did you mean 'limits_above_probe'?"),
    ):
        spill.write_text(good + f"\n[overrides]\n{bad}\n")
        with pytest.raises(ProblemsError) as caught:
            load_desired(desired)
        assert any(str(p).startswith(f"{spill}: {said}") for p in caught.value.problems), caught.value.problems


def test_the_lanes_whose_jobs_run_on_a_host() -> None:
    """A compute lane's on its push host (its agent), the local lane's on the control host (phaze's own processing)."""
    from reconciler.core.desired.load import load_desired
    from tests.conftest import EXAMPLE_FLEET

    desired = load_desired(EXAMPLE_FLEET)
    assert {host: [lane.id for lane in desired.lanes_on(host)] for host in sorted(desired.hosts)} == {
        "a1-arm64": ["a1-arm64"],
        "lux": ["local"],
        "qfox-1": [],
        "racknerd": [],
        "x86-spill": ["x86-spill"],
    }
    # The same hosts in one pass (the leader's scaling step at thousands of hosts).
    assert desired.lane_hosts() == {host for host in desired.hosts if desired.lanes_on(host)} == {"a1-arm64", "lux", "x86-spill"}
