"""The plan signing key file (reconciler.adapters.plan_signing) and `fabric leader keygen`."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from reconciler.adapters.plan_signing import KeyFileSigner, generate_key_file
from reconciler.core.desired.load import load_desired
from reconciler.ports import PlanSigningError
from tests.support.plan_keys import TestKey, signed_example_fleet, with_plan_keys


def test_keygen_writes_a_0600_key_and_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "plan.key"
    public = generate_key_file(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    signer = KeyFileSigner(out)
    assert signer.public_key() == public
    Ed25519PublicKey.from_public_bytes(public).verify(signer.sign(b"plan"), b"plan")
    before = out.read_bytes()
    with pytest.raises(PlanSigningError, match="already exists"):
        generate_key_file(out)
    assert out.read_bytes() == before


def test_a_key_file_readable_by_others_is_refused_without_quoting_it(tmp_path: Path) -> None:
    key = TestKey("lux", "lux-x").write(tmp_path / "plan.key")
    os.chmod(key, 0o644)
    with pytest.raises(PlanSigningError) as refused:
        KeyFileSigner(key).public_key()
    assert str(refused.value) == f"{key}: the plan signing key is open to group or others (mode 0644); chmod 600 it"


def test_a_missing_or_foreign_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanSigningError, match="cannot read the plan signing key"):
        KeyFileSigner(tmp_path / "absent.key").sign(b"x")
    junk = tmp_path / "junk.key"
    junk.write_text("-----BEGIN PRIVATE KEY-----\nc2VjcmV0\n-----END PRIVATE KEY-----\n")
    os.chmod(junk, 0o600)
    with pytest.raises(PlanSigningError) as refused:
        KeyFileSigner(junk).sign(b"x")
    assert "c2VjcmV0" not in str(refused.value)


def test_fabric_leader_keygen_prints_plan_keys_lines_that_validate(tmp_path: Path) -> None:
    out = tmp_path / "lux.key"
    proc = subprocess.run(
        [sys.executable, "-m", "reconciler", "leader", "keygen", "--out", str(out), "--host", "lux", "--id", "lux-2027-01"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert out.read_text() not in proc.stdout + proc.stderr  # the private key is never printed
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert lines[:3] == ["[[plan_keys]]", 'host = "lux"', 'id = "lux-2027-01"']
    public = lines[3].split('"')[1]
    assert base64.b64decode(public) == KeyFileSigner(out).public_key()
    fleet = signed_example_fleet(tmp_path / "f")
    fleet_toml = fleet.desired / "fabric.toml"
    fleet_toml.write_text(with_plan_keys(fleet_toml.read_text(), []) + "\n".join(lines) + "\n")
    assert [k.id for k in load_desired(fleet.desired).fleet.plan_keys] == ["lux-2027-01"]
    again = subprocess.run(
        [sys.executable, "-m", "reconciler", "leader", "keygen", "--out", str(out), "--host", "lux"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1 and "already exists" in again.stderr
