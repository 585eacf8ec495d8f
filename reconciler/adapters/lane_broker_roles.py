"""phaze's broker's roles (`fabric lane init-roles`): what PostgreSQL's
catalogs hold of the fabric-* roles, and each change of
`core.desired.broker_access.role_steps`, made with the tables' owner's DSN.

The DSN never leaves this module (read from its file by reconciler.wiring);
errors are psycopg's first line without it (`lane_broker_pg._first_line`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg import sql

from reconciler.adapters.lane_broker_pg import _first_line, broker_session, dropped, dsn_secrets, make_tables
from reconciler.core.desired.broker_access import (
    MANAGED_PREFIX,
    ROW_SECURED,
    SAQ_VERSIONS,
    SEQUENCES,
    TABLES,
    BrokerState,
    Policy,
    RoleStep,
    search_path_of,
)
from reconciler.ports import LaneBrokerError, LaneBrokerUnavailable


class PostgresBrokerRoles:
    """`reconciler.ports.BrokerRoleAdmin` on one PostgreSQL database."""

    def __init__(self, dsn: str, *, timeout_s: float = 5.0) -> None:
        self._dsn = dsn
        self._secrets = dsn_secrets(dsn)
        self._timeout = timeout_s
        self._conn: psycopg.Connection[Any] | None = None

    def _session(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        return broker_session(self)

    def close(self) -> None:
        self._conn = dropped(self._conn)

    def make_tables(self) -> list[str]:
        from psycopg_pool import PoolTimeout

        try:
            return make_tables(self._dsn, self._timeout)
        except (psycopg.OperationalError, OSError, PoolTimeout, TimeoutError) as exc:
            raise LaneBrokerUnavailable(f"phaze's broker: {_first_line(exc, self._secrets)}") from None
        except psycopg.Error as exc:
            raise LaneBrokerError(f"phaze's broker refused: {_first_line(exc, self._secrets)}") from None

    def role_state(self) -> BrokerState:
        managed = f"{MANAGED_PREFIX}%"
        with self._session() as conn:
            roles = frozenset(r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE %s", (managed,)).fetchall())
            privileges = frozenset(
                (role, obj, privilege)
                for role, obj, privilege in conn.execute(
                    "SELECT r.rolname, c.relname, a.privilege_type FROM pg_class c"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'"
                    " CROSS JOIN LATERAL aclexplode(c.relacl) a JOIN pg_roles r ON r.oid = a.grantee"
                    " WHERE c.relname = ANY(%s) AND r.rolname LIKE %s",
                    ([*TABLES, *SEQUENCES], managed),
                ).fetchall()
            )
            secured = frozenset(
                t
                for (t,) in conn.execute(
                    "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'"
                    " WHERE c.relname = ANY(%s) AND c.relrowsecurity",
                    (list(ROW_SECURED),),
                ).fetchall()
            )
            policies = {
                (table, name): comment
                for table, name, comment in conn.execute(
                    "SELECT c.relname, p.polname, obj_description(p.oid, 'pg_policy') FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public' WHERE c.relname = ANY(%s)",
                    (list(ROW_SECURED),),
                ).fetchall()
            }
            schemas = frozenset(
                role
                for (role,) in conn.execute(
                    # CASE: the view's privilege is asked only of a view that is there.
                    "SELECT r.rolname FROM pg_roles r JOIN pg_namespace n ON n.nspname = r.rolname"
                    " WHERE r.rolname LIKE %s AND has_schema_privilege(r.rolname, n.oid, 'USAGE') AND has_schema_privilege(r.rolname, n.oid, 'CREATE')"
                    " AND CASE WHEN to_regclass(format('%%I.%%I', r.rolname, %s::text)) IS NULL THEN false"
                    " ELSE has_table_privilege(r.rolname, to_regclass(format('%%I.%%I', r.rolname, %s::text)), 'SELECT') END",
                    (managed, SAQ_VERSIONS, SAQ_VERSIONS),
                ).fetchall()
            )
            paths: dict[str, str | None] = {}
            for role, settings in conn.execute(
                "SELECT r.rolname, s.setconfig FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole"
                " WHERE s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) AND r.rolname LIKE %s",
                (managed,),
            ).fetchall():
                for setting in settings or []:
                    if setting.startswith("search_path="):
                        paths[role] = setting.removeprefix("search_path=")
        return BrokerState(roles=roles, privileges=privileges, row_security=secured, policies=policies, schemas=schemas, search_paths=paths)

    def apply_role_step(self, step: RoleStep) -> None:
        with self._session() as conn, conn.transaction():
            for statement in _statements(step, conn):
                conn.execute(statement)


def _statements(step: RoleStep, conn: psycopg.Connection[Any]) -> list[sql.Composable]:
    role = sql.Identifier(step.role or "")
    if step.kind == "create_role":
        return [sql.SQL("CREATE ROLE {} LOGIN").format(role)]
    if step.kind in ("grant", "revoke"):
        assert step.privilege is not None and step.table is not None
        kind = sql.SQL("SEQUENCE" if step.table in SEQUENCES else "TABLE")
        verb, word = ("GRANT", "TO") if step.kind == "grant" else ("REVOKE", "FROM")
        return [
            sql.SQL("{} {} ON {} {} {} {}").format(
                sql.SQL(verb), sql.SQL(step.privilege), kind, sql.Identifier("public", step.table), sql.SQL(word), role
            )
        ]
    if step.kind == "row_security":
        return [sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(sql.Identifier("public", step.table or ""))]
    if step.kind == "policy":
        assert step.policy is not None
        return _policy(step.policy)
    if step.kind == "drop_policy":
        return [sql.SQL("DROP POLICY IF EXISTS {} ON {}").format(role, sql.Identifier("public", step.table or ""))]
    if step.kind == "schema":
        view = sql.Identifier(step.role or "", SAQ_VERSIONS)
        return [
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(role),
            sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(role, role),
            sql.SQL("CREATE OR REPLACE VIEW {} AS SELECT version FROM {}").format(view, sql.Identifier("public", SAQ_VERSIONS)),
            sql.SQL("GRANT SELECT ON {} TO {}").format(view, role),
        ]
    database = conn.execute("SELECT current_database()").fetchone()
    assert database is not None
    return [sql.SQL("ALTER ROLE {} IN DATABASE {} SET search_path = {}").format(role, sql.Identifier(database[0]), sql.SQL(_path(step.role or "")))]


def _path(role: str) -> str:
    """search_path_of(role), its identifier quoted as PostgreSQL quotes it."""
    assert search_path_of(role) == f'"{role}", public' and '"' not in role
    return search_path_of(role)


def _policy(policy: Policy) -> list[sql.Composable]:
    name, table = sql.Identifier(policy.role), sql.Identifier("public", policy.table)
    if policy.queues is None:
        rows: sql.Composable = sql.SQL("true")
    else:
        rows = sql.SQL("{} = ANY(ARRAY[{}]::text[])").format(sql.Identifier(policy.column), sql.SQL(", ").join(sql.Literal(q) for q in policy.queues))
    return [
        sql.SQL("DROP POLICY IF EXISTS {} ON {}").format(name, table),
        sql.SQL("CREATE POLICY {} ON {} AS PERMISSIVE FOR ALL TO {} USING ({}) WITH CHECK ({})").format(name, table, name, rows, rows),
        sql.SQL("COMMENT ON POLICY {} ON {} IS {}").format(name, table, sql.Literal(policy.definition)),
    ]
