"""Who may write what in an etcd registry: per-host identities, from the desired state.

Every host reaches etcd with its own TLS client certificate (CN = host name;
with etcd's auth enabled, `--client-cert-auth` makes the CN the user name).
`registry_access(desired)` is what etcd should hold; `auth_steps(want, have)`
the changes that take a cluster there (`fabric registry init-auth` applies
them). Under the prefix P of [registry] (key layout:
reconciler/adapters/registry_etcd.py):

    role fabric-host-<host>  read P/ (the whole prefix: the live state is no secret);
                             readwrite P/nodes/<host>, P/facts/<host> and
                             P/liveness/<host> (fabric-watch's fast liveness), and on an
                             edge host P/edge-upstreams/<host> (its Caddy's failed upstreams; exact keys:
                             a prefix permission on P/nodes/x86 would also cover
                             P/nodes/x86-spill); its heartbeat's lease needs no
                             permission (etcd 3.4 grants and keeps alive leases for
                             any authenticated user)
    role fabric-leader       readwrite P/ (the prefix): the leader key, the epoch,
                             the plan, node states, scaling,
                             drains; given to fleet.leader_candidates only
    role fabric-admin        read P/; readwrite P/drain/ (the prefix): an
                             operator's `fabric drain` / `fabric undrain`
    role fabric-joining      readwrite P/pending/ (the prefix) and nothing else: a
                             machine without a host file reports itself pending
                             (one identity for every joining machine: none has a
                             name the fleet knows yet; a pending report carries
                             no authority, so what it may write is worthless
                             to an attacker beyond the report itself)
    role fabric-group-<g>    read P/; readwrite P/members/<g>/ (the prefix) and
                             nothing else: the members of worker group <g>
                             (fabric.toml [groups.<g>]) report themselves
                             there; one identity per group, handed by the
                             group's hook to the workers it starts as
                             credential files. It proves the group, never a
                             tier: the leader admits members with the group's
                             declared settings and caps their number
    user <host>              fabric-host-<host>, and fabric-leader for a candidate
    user fabric-group-<g>    fabric-group-<g> (the CN of the group's certificate)
    user fabric-admin        fabric-admin (the operator's identity; no host)
    user fabric-joining      fabric-joining ([registry] joining_cert_file's CN)
    user root                etcd's root role (init-auth's own identity; etcd
                             refuses to enable auth without it)

Drains are written by candidates and the operator, not by the drained host:
a host that could lift its own drain could pull work back onto itself while
an operator keeps it out (suspected, under maintenance); a host that wants
out can always stop beating. Every user is created without a password: only
a certificate of the fleet's CA with that CN speaks for it.

Only roles named fabric-* are managed: a permission of a fabric-* role that
is not wanted is revoked, and a fabric-* role a user should not hold (a host
no longer a candidate, a host removed from the desired state) is revoked from
that user. Users are never deleted, and other roles and users are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from reconciler.core.desired.model import DesiredState

Access = Literal["read", "write", "readwrite"]

ROOT = "root"
ADMIN_USER = "fabric-admin"
LEADER_ROLE = "fabric-leader"
ADMIN_ROLE = "fabric-admin"
JOINING_USER = "fabric-joining"
JOINING_ROLE = "fabric-joining"
MANAGED_ROLE_PREFIX = "fabric-"


def host_role(host: str) -> str:
    return f"fabric-host-{host}"


def group_role(group: str) -> str:
    """The etcd role, and user (its certificate's CN), of worker group `group`'s members."""
    return f"fabric-group-{group}"


@dataclass(frozen=True, order=True)
class Grant:
    """One etcd key permission: the range [key, range_end), or the one key when
    range_end is empty (etcd's own encoding)."""

    key: str
    range_end: str
    access: Access

    def describe(self) -> str:
        if not self.range_end:
            return f"{self.access} {self.key}"
        if self.range_end == prefix_end(self.key):
            return f"{self.access} {self.key}* (prefix)"
        return f"{self.access} [{self.key}, {self.range_end})"


def prefix_end(prefix: str) -> str:
    """The range_end of a prefix permission: the prefix with its last
    character raised by one ("/fabric/" -> "/fabric0"), as etcdctl --prefix does."""
    if not prefix:
        raise ValueError("an empty prefix is the whole keyspace")
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def prefix_grant(prefix: str, access: Access) -> Grant:
    return Grant(prefix, prefix_end(prefix), access)


@dataclass(frozen=True)
class AccessState:
    """Roles with their permissions and users with their roles: what etcd holds,
    or what it should hold."""

    roles: Mapping[str, frozenset[Grant]]
    users: Mapping[str, frozenset[str]]
    auth_enabled: bool = True


def registry_access(desired: DesiredState) -> AccessState:
    """The roles and users the desired state asks for (every declared host,
    candidates from fleet.leader_candidates), auth enabled."""
    base = desired.fleet.registry.prefix.rstrip("/") + "/"
    read_all = prefix_grant(base, "read")
    candidates = set(desired.fleet.fleet.leader_candidates)
    roles: dict[str, frozenset[Grant]] = {
        LEADER_ROLE: frozenset({prefix_grant(base, "readwrite")}),
        ADMIN_ROLE: frozenset({read_all, prefix_grant(base + "drain/", "readwrite")}),
        JOINING_ROLE: frozenset({prefix_grant(base + "pending/", "readwrite")}),
    }
    users: dict[str, frozenset[str]] = {ROOT: frozenset({ROOT}), ADMIN_USER: frozenset({ADMIN_ROLE}), JOINING_USER: frozenset({JOINING_ROLE})}
    for host in sorted(desired.hosts):
        roles[host_role(host)] = frozenset(
            {
                read_all,
                Grant(f"{base}nodes/{host}", "", "readwrite"),
                Grant(f"{base}facts/{host}", "", "readwrite"),
                Grant(f"{base}liveness/{host}", "", "readwrite"),
            }
            # An edge's record of its Caddy's failed upstreams (issue 30): its own key only.
            | ({Grant(f"{base}edge-upstreams/{host}", "", "readwrite")} if "edge" in desired.hosts[host].host.roles else set())
        )
        users[host] = frozenset({host_role(host), LEADER_ROLE} if host in candidates else {host_role(host)})
    for group in sorted(desired.fleet.groups):
        roles[group_role(group)] = frozenset({read_all, prefix_grant(f"{base}members/{group}/", "readwrite")})
        users[group_role(group)] = frozenset({group_role(group)})
    return AccessState(roles=roles, users=users, auth_enabled=True)


@dataclass(frozen=True)
class AuthStep:
    """One change to etcd's auth state, in the order it must be made."""

    kind: Literal["add_role", "grant_permission", "revoke_permission", "add_user", "grant_role", "revoke_role", "enable_auth"]
    name: str = ""  # the role (add_role, *_permission) or user (add_user, *_role)
    role: str = ""  # grant_role, revoke_role
    grant: Grant | None = None  # grant_permission, revoke_permission

    def describe(self) -> str:
        if self.kind == "add_role":
            return f"created role {self.name}"
        if self.kind == "grant_permission" and self.grant is not None:
            return f"granted {self.name} {self.grant.describe()}"
        if self.kind == "revoke_permission" and self.grant is not None:
            return f"revoked from {self.name} {self.grant.describe()}"
        if self.kind == "add_user":
            return f"created user {self.name} (no password: its certificate's CN speaks for it)"
        if self.kind == "grant_role":
            return f"granted role {self.role} to user {self.name}"
        if self.kind == "revoke_role":
            return f"revoked role {self.role} from user {self.name}"
        return "enabled auth"


def _same_range(a: Grant, b: Grant) -> bool:
    return (a.key, a.range_end) == (b.key, b.range_end)


def auth_steps(want: AccessState, have: AccessState) -> list[AuthStep]:
    """The steps from `have` to `want`: roles and their permissions first, then
    users and their roles, revocations, and enabling auth last (so auth is never
    on before every identity can do its work). Empty when nothing is to do."""
    steps: list[AuthStep] = []
    for role in sorted(want.roles):
        held = have.roles.get(role)
        if held is None:
            steps.append(AuthStep("add_role", name=role))
            held = frozenset()
        for grant in sorted(want.roles[role] - held):
            steps.append(AuthStep("grant_permission", name=role, grant=grant))
        # etcd keeps one permission per range: granting a range it holds with
        # another access replaces it, so only ranges no longer wanted are revoked.
        for grant in sorted(held - want.roles[role]):
            if not any(_same_range(grant, w) for w in want.roles[role]):
                steps.append(AuthStep("revoke_permission", name=role, grant=grant))
    for user in sorted(want.users):
        held_roles = have.users.get(user)
        if held_roles is None:
            steps.append(AuthStep("add_user", name=user))
            held_roles = frozenset()
        for role in sorted(want.users[user] - held_roles):
            steps.append(AuthStep("grant_role", name=user, role=role))
    for user in sorted(have.users):
        wanted = want.users.get(user, frozenset())
        for role in sorted(have.users[user] - wanted):
            if role.startswith(MANAGED_ROLE_PREFIX):
                steps.append(AuthStep("revoke_role", name=user, role=role))
    if want.auth_enabled and not have.auth_enabled:
        steps.append(AuthStep("enable_auth"))
    return steps
