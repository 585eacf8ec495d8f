"""Secrets on disk are checked: the DSN file ([phaze] queue_url_file), the
etcd client key ([registry] key_file) and the plan signing key are used only
when they are owned by root or the running user and no one else may read
them; every refusal names the path and the mode or owner, never the content,
and no message ever shows a DSN or its password."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker, _first_line, dsn_secrets
from reconciler.adapters.plan_signing import KeyFileSigner
from reconciler.adapters.registry_etcd import EtcdRegistry
from reconciler.adapters.secret_files import SecretFileRefused, read_secret_file
from reconciler.cli import EXIT_FAILED, main
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.ports import LaneBrokerUnavailable, PlanSigningError, RegistryError
from reconciler.wiring import open_lane_broker
from tests.conftest import EXAMPLE_FLEET, require_root
from tests.support.clock import FakeClock
from tests.support.plan_keys import TestKey

PASSWORD = "hunter2-Sekr1t"
DSN = f"postgresql://phaze:{PASSWORD}@127.0.0.1:9/phaze"
KEY_PEM = b"-----BEGIN PRIVATE KEY-----\nTUlJQ0FOT1RBUkVBTEtFWQ==\n-----END PRIVATE KEY-----\n"
OTHER_UID = 54321


def secret(path: Path, content: bytes | str, mode: int = 0o600, uid: int | None = None) -> Path:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    os.chmod(path, mode)
    if uid is not None:
        require_root()
        os.chown(path, uid, -1)
    return path


def never_quotes(message: str, *contents: str) -> None:
    for content in contents:
        assert content not in message, message


# -- the rule itself ------------------------------------------------------------------


def test_a_private_file_of_this_user_is_read(tmp_path: Path) -> None:
    assert read_secret_file(secret(tmp_path / "s", "x"), "a secret") == b"x"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o602, 0o610])
def test_a_file_open_to_group_or_others_is_refused_with_its_path_and_mode(tmp_path: Path, mode: int) -> None:
    path = secret(tmp_path / "s", DSN, mode)
    with pytest.raises(SecretFileRefused) as refused:
        read_secret_file(path, "phaze's queue URL")
    assert str(refused.value) == f"{path}: phaze's queue URL is open to group or others (mode {mode:04o}); chmod 600 it"


def test_a_file_of_another_user_is_refused_with_its_owner(tmp_path: Path) -> None:
    path = secret(tmp_path / "s", DSN, 0o600, uid=OTHER_UID)
    with pytest.raises(SecretFileRefused) as refused:
        read_secret_file(path, "phaze's queue URL")
    assert f"{path}: phaze's queue URL is owned by uid {OTHER_UID}, neither root nor the user this runs as" in str(refused.value)
    never_quotes(str(refused.value), DSN, PASSWORD)


def test_a_file_of_root_is_read(tmp_path: Path) -> None:
    path = secret(tmp_path / "s", "x", 0o600, uid=0)
    assert read_secret_file(path, "a secret") == b"x"


def test_a_directory_a_missing_file_and_a_huge_one_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretFileRefused, match="is not a regular file"):
        read_secret_file(tmp_path, "a secret")
    with pytest.raises(SecretFileRefused, match="cannot read a secret: No such file or directory"):
        read_secret_file(tmp_path / "absent", "a secret")
    with pytest.raises(SecretFileRefused, match="is over 65536 bytes"):
        read_secret_file(secret(tmp_path / "big", "x" * 70_000), "a secret")


# -- the DSN file ([phaze] queue_url_file) ------------------------------------------------


@pytest.fixture(scope="module")
def fleet():
    return load_desired(EXAMPLE_FLEET).fleet


@pytest.mark.parametrize("mode, uid", [(0o644, None), (0o640, None), (0o600, OTHER_UID)])
def test_the_dsn_file_is_refused_unless_private(tmp_path: Path, fleet, mode: int, uid: int | None) -> None:
    path = secret(tmp_path / "queue_url", DSN, mode, uid)
    with pytest.raises(LaneBrokerUnavailable) as refused:
        open_lane_broker(fleet, dsn_file=path)
    message = str(refused.value)
    assert message.startswith(f"{path}: phaze's queue URL is ")
    assert f"mode {mode:04o}" in message if uid is None else f"uid {uid}" in message
    never_quotes(message, DSN, PASSWORD)


def test_fabric_lane_status_with_an_open_dsn_file_exits_1_naming_the_file_never_the_dsn(tmp_path: Path) -> None:
    path = secret(tmp_path / "queue_url", DSN, 0o644)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(
            ["lane", "status", "--desired", str(EXAMPLE_FLEET), "--registry-path", str(tmp_path / "r.sqlite"), "--queue-url-file", str(path)]
        )
    assert status == EXIT_FAILED
    assert f"{path}: phaze's queue URL is open to group or others (mode 0644)" in err.getvalue(), err.getvalue()
    never_quotes(out.getvalue() + err.getvalue(), DSN, PASSWORD)


def test_fabric_lane_init_roles_with_an_open_owner_dsn_file_exits_1_naming_the_file_never_the_dsn(tmp_path: Path) -> None:
    """The broker owner's DSN (init-roles' --admin-url-file) is a secret file like any other."""
    path = secret(tmp_path / "owner_url", DSN, 0o644)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["lane", "init-roles", "--desired", str(EXAMPLE_FLEET), "--admin-url-file", str(path)])
    assert status == EXIT_FAILED
    assert f"{path}: phaze's queue URL is open to group or others (mode 0644)" in err.getvalue(), err.getvalue()
    assert out.getvalue() == "", "nothing done"
    never_quotes(out.getvalue() + err.getvalue(), DSN, PASSWORD)


@pytest.mark.parametrize(
    "argv",
    [
        ["lane", "init-roles", "--desired", str(EXAMPLE_FLEET)],
        ["lane", "status", "--desired", str(EXAMPLE_FLEET), "--admin-url-file", "/nonexistent"],
        ["lane", "dispatch", "--desired", str(EXAMPLE_FLEET), "--dry-run"],
    ],
)
def test_init_roles_options_go_with_init_roles_alone(argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "--admin-url-file (and --dry-run) go with init-roles" in err.getvalue()


@pytest.mark.parametrize(
    "dsn, password",
    [
        ("postgresql://phaze:p%zzss@127.0.0.1:9/phaze", "p%zzss"),  # libpq: 'invalid percent-encoded token: "p%zzss"'
        ("postgresql://phaze:%4@127.0.0.1:9/phaze", "%4"),
    ],
)
def test_a_dsn_that_does_not_parse_is_refused_naming_the_file_never_its_password(tmp_path: Path, fleet, dsn: str, password: str) -> None:
    path = secret(tmp_path / "queue_url", dsn)
    with pytest.raises(LaneBrokerUnavailable) as refused:
        open_lane_broker(fleet, dsn_file=path)
    assert str(refused.value) == f"{path}: phaze's queue URL does not parse as a PostgreSQL URL (libpq refuses it; its text is not shown)"
    with pytest.raises(LaneBrokerUnavailable) as direct:
        PostgresLaneBroker(dsn, FakeClock(), connect_timeout_s=1)
    never_quotes(str(direct.value), dsn, password)


@pytest.mark.parametrize(
    "dsn, password",
    [
        ("postgresql://phaze:hunter2@127.0.0.1:notaport/phaze", "hunter2"),
        ("postgresql://phaze:hunter2@127.0.0.1:9/phaze?sslmode=hunter2-mode", "hunter2"),
        ("postgresql://phaze:hunter2@127.0.0.1:9/phaze?connect_timeout=hunter2", "hunter2"),
    ],
)
def test_a_dsn_libpq_refuses_at_connect_never_shows_its_password(tmp_path: Path, fleet, dsn: str, password: str) -> None:
    path = secret(tmp_path / "queue_url", dsn)
    with pytest.raises(LaneBrokerUnavailable) as refused:
        open_lane_broker(fleet, dsn_file=path)
    never_quotes(str(refused.value), dsn, password)


def test_a_broker_error_quoting_the_dsn_or_its_password_is_redacted() -> None:
    for text in (f"could not connect with {DSN}", f'invalid percent-encoded token: "{PASSWORD}"', f"password={PASSWORD} refused"):
        never_quotes(_first_line(Exception(text), dsn_secrets(DSN)), DSN, PASSWORD)
    keyword = "host=db user=phaze password='two words'"
    never_quotes(_first_line(Exception(f"bad: {keyword}"), dsn_secrets(keyword)), "two words")


def test_a_broker_that_does_not_answer_names_no_password(fleet) -> None:
    """A well-formed DSN to a port nothing listens on: the error is the broker's, without the password."""
    with pytest.raises(LaneBrokerUnavailable) as refused:
        PostgresLaneBroker(DSN, FakeClock(), connect_timeout_s=1)
    never_quotes(str(refused.value), DSN, PASSWORD)


# -- the etcd client key ([registry] key_file) -------------------------------------------------


def etcd_with_key(tmp_path: Path, key: Path) -> EtcdRegistry:
    ca = secret(tmp_path / "ca.crt", "ca", 0o644)
    cert = secret(tmp_path / "host.crt", "cert", 0o644)  # certificates are public
    return EtcdRegistry(
        ["https://127.0.0.1:9"],
        timing=TimingSettings(),
        flap=FlapSettings(),
        clock=FakeClock(),
        ca_file=str(ca),
        cert_file=str(cert),
        key_file=str(key),
    )


@pytest.mark.parametrize("mode, uid", [(0o644, None), (0o640, None), (0o600, OTHER_UID)])
def test_the_etcd_client_key_is_refused_unless_private(tmp_path: Path, mode: int, uid: int | None) -> None:
    key = secret(tmp_path / "host.key", KEY_PEM, mode, uid)
    with pytest.raises(RegistryError) as refused:
        etcd_with_key(tmp_path, key)
    message = str(refused.value)
    assert message.startswith(f"etcd TLS file: {key}: the etcd client key is ")
    assert f"mode {mode:04o}" in message if uid is None else f"uid {uid}" in message
    never_quotes(message, KEY_PEM.decode().splitlines()[1])


def test_fabric_nodes_with_an_open_etcd_key_exits_1_naming_the_file(tmp_path: Path) -> None:
    key = secret(tmp_path / "host.key", KEY_PEM, 0o644)
    ca = secret(tmp_path / "ca.crt", "ca", 0o644)
    cert = secret(tmp_path / "host.crt", "cert", 0o644)
    desired = tmp_path / "desired"
    desired.mkdir()
    for host in EXAMPLE_FLEET.glob("*.toml"):
        (desired / host.name).write_text(host.read_text())
    toml = desired / "fabric.toml"
    text = toml.read_text().replace(
        'backend = "sqlite"        # embedded default; "etcd" for the fleet\npath = "/var/lib/fabric/registry.sqlite"\n',
        f'backend = "etcd"\nendpoints = ["https://127.0.0.1:9"]\nca_file = "{ca}"\ncert_file = "{cert}"\nkey_file = "{key}"\n',
    )
    assert 'backend = "etcd"' in text
    toml.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["nodes", "--desired", str(desired)])
    assert status == EXIT_FAILED
    assert f"{key}: the etcd client key is open to group or others (mode 0644); chmod 600 it" in err.getvalue(), err.getvalue()
    never_quotes(out.getvalue() + err.getvalue(), KEY_PEM.decode().splitlines()[1])


# -- the plan signing key ------------------------------------------------------------------


@pytest.mark.parametrize("mode, uid", [(0o644, None), (0o640, None), (0o600, OTHER_UID)])
def test_the_plan_key_is_refused_unless_private(tmp_path: Path, mode: int, uid: int | None) -> None:
    key = TestKey("lux", "lux-x").write(tmp_path / "plan.key")
    content = key.read_text().splitlines()[1]
    os.chmod(key, mode)
    if uid is not None:
        require_root()
        os.chown(key, uid, -1)
    with pytest.raises(PlanSigningError) as refused:
        KeyFileSigner(key).public_key()
    message = str(refused.value)
    assert message.startswith(f"{key}: the plan signing key is ")
    assert f"mode {mode:04o}" in message if uid is None else f"uid {uid}" in message
    never_quotes(message, content)


def test_a_plan_key_through_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    key = TestKey("lux", "lux-x").write(tmp_path / "plan.key")
    link = tmp_path / "link.key"
    link.symlink_to(key)
    with pytest.raises(PlanSigningError, match="cannot read the plan signing key"):
        KeyFileSigner(link).public_key()
