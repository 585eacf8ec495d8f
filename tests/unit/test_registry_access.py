"""The etcd roles and users the desired state asks for, and the steps from
what etcd holds to them (reconciler.core.desired.registry_access)."""

from __future__ import annotations

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.registry_access import (
    AccessState,
    AuthStep,
    Grant,
    auth_steps,
    prefix_end,
    registry_access,
)
from tests.conftest import EXAMPLE_FLEET


def example():
    desired = load_desired(EXAMPLE_FLEET)
    return desired, registry_access(desired)


def test_prefix_permissions_end_where_the_prefix_ends():
    assert prefix_end("/fabric/") == "/fabric0"
    assert prefix_end("/fabric/drain/") == "/fabric/drain0"


def test_every_host_writes_only_its_own_keys_and_candidates_lead():
    desired, want = example()
    assert set(want.users) == {*desired.hosts, "root", "fabric-admin", "fabric-joining", "fabric-group-batch"}
    # The members of the example's worker group report with the group's identity: its prefix, and reads.
    assert want.roles["fabric-group-batch"] == {
        Grant("/fabric/", "/fabric0", "read"),
        Grant("/fabric/members/batch/", "/fabric/members/batch0", "readwrite"),
    }
    # A machine without a host file reports pending with the joining identity: that prefix and nothing else.
    assert want.roles["fabric-joining"] == {Grant("/fabric/pending/", "/fabric/pending0", "readwrite")}
    assert want.roles["fabric-host-racknerd"] == {
        Grant("/fabric/", "/fabric0", "read"),
        Grant("/fabric/nodes/racknerd", "", "readwrite"),
        Grant("/fabric/facts/racknerd", "", "readwrite"),
        Grant("/fabric/liveness/racknerd", "", "readwrite"),
        # racknerd is the edge: its Caddy's failed upstreams (issue 30), its own key only.
        Grant("/fabric/edge-upstreams/racknerd", "", "readwrite"),
    }
    assert not [g for g in want.roles["fabric-host-lux"] if "edge-upstreams" in g.key], "only an edge host reports its upstreams"
    leaders = {user for user, roles in want.users.items() if "fabric-leader" in roles}
    assert leaders == set(desired.fleet.fleet.leader_candidates)
    assert want.roles["fabric-leader"] == {Grant("/fabric/", "/fabric0", "readwrite")}
    assert Grant("/fabric/drain/", "/fabric/drain0", "readwrite") in want.roles["fabric-admin"]
    assert want.users["root"] == {"root"}


def test_from_nothing_auth_is_enabled_last_and_then_nothing_is_left_to_do():
    _, want = example()
    steps = auth_steps(want, AccessState(roles={}, users={}, auth_enabled=False))
    assert steps[-1] == AuthStep("enable_auth")
    kinds = [s.kind for s in steps]
    assert kinds.index("add_user") > max(i for i, k in enumerate(kinds) if k == "grant_permission"), "roles before users"
    assert auth_steps(want, want) == []


def test_a_demoted_candidate_and_a_removed_host_lose_their_fabric_roles():
    _, want = example()
    have = AccessState(
        roles={**want.roles, "fabric-host-gone": frozenset({Grant("/fabric/nodes/gone", "", "readwrite")})},
        users={**want.users, "racknerd": want.users["racknerd"] | {"fabric-leader"}, "gone": frozenset({"fabric-host-gone", "ops"})},
    )
    assert auth_steps(want, have) == [
        AuthStep("revoke_role", name="gone", role="fabric-host-gone"),
        AuthStep("revoke_role", name="racknerd", role="fabric-leader"),
    ], "only fabric-* roles are revoked; users are kept"


def test_a_permission_beyond_the_wanted_ones_is_revoked_and_a_changed_access_regranted():
    _, want = example()
    role = "fabric-host-lux"
    have = AccessState(
        roles={
            **want.roles,
            role: frozenset({Grant("/fabric/nodes/", "/fabric/nodes0", "readwrite"), Grant("/fabric/", "/fabric0", "readwrite")})
            | {Grant("/fabric/nodes/lux", "", "readwrite"), Grant("/fabric/facts/lux", "", "readwrite")}
            | {Grant("/fabric/liveness/lux", "", "readwrite")},
        },
        users=want.users,
    )
    assert auth_steps(want, have) == [
        AuthStep("grant_permission", name=role, grant=Grant("/fabric/", "/fabric0", "read")),
        AuthStep("revoke_permission", name=role, grant=Grant("/fabric/nodes/", "/fabric/nodes0", "readwrite")),
    ]
