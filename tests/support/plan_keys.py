"""Plan signing keys for tests: throwaway ed25519 keypairs, and the example fleet listing them.

hosts/fabric.toml lists the real public keys of lux and qfox-1, whose private
halves are on those machines only. A test that leads over the example fleet
uses a copy whose [[plan_keys]] are replaced by keys made here:

    fleet = signed_example_fleet(tmp_path)       # (the `signed_fleet` fixture of tests/conftest.py)
    fleet.desired                                # the copy's directory
    fleet.key_file("lux")                        # lux's private key, PEM, 0600 (--plan-key-file)
    fleet.signer("lux")                          # a PlanSigner over it, for fake ports
"""

from __future__ import annotations

import base64
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.conftest import EXAMPLE_FLEET

CANDIDATES = ("lux", "qfox-1")


@dataclass(frozen=True)
class TestKey:
    host: str
    id: str
    private: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate, repr=False)

    @property
    def public_raw(self) -> bytes:
        return self.private.public_key().public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)

    @property
    def public_b64(self) -> str:
        return base64.b64encode(self.public_raw).decode()

    def toml(self) -> str:
        return f'[[plan_keys]]\nhost = "{self.host}"\nid = "{self.id}"\npublic_key = "{self.public_b64}"\n'

    def write(self, path: Path) -> Path:
        pem = self.private.private_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PrivateFormat.PKCS8,
            encryption_algorithm=serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pem)
        os.chmod(path, 0o600)
        return path

    def signer(self) -> FakeSigner:
        return FakeSigner(self.private, f"test key {self.id}")


class FakeSigner:
    """The PlanSigner port over an in-memory key."""

    __test__ = False

    def __init__(self, private: Ed25519PrivateKey, where: str = "test key") -> None:
        self.private = private
        self.where = where
        self.signed = 0

    def public_key(self) -> bytes:
        return self.private.public_key().public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)

    def sign(self, message: bytes) -> bytes:
        self.signed += 1
        return self.private.sign(message)

    def describe(self) -> str:
        return self.where


TestKey.__test__ = False  # type: ignore[attr-defined]


def with_plan_keys(fleet_toml: str, keys: list[TestKey]) -> str:
    """fabric.toml's text with its [[plan_keys]] tables (kept last) replaced by `keys`."""
    lines = fleet_toml.splitlines(keepends=True)
    cut = next((i for i, line in enumerate(lines) if line.strip() == "[[plan_keys]]"), len(lines))
    return "".join(lines[:cut]) + "\n".join(key.toml() for key in keys)


@dataclass
class SignedFleet:
    desired: Path
    keys: dict[str, TestKey]
    key_dir: Path

    def key_file(self, host: str) -> Path:
        path = self.key_dir / f"{host}.key"
        return path if path.exists() else self.keys[host].write(path)

    def signer(self, host: str) -> FakeSigner:
        return self.keys[host].signer()


def signed_example_fleet(directory: Path, source: Path = EXAMPLE_FLEET) -> SignedFleet:
    """A copy of the example fleet in directory/desired whose lux and qfox-1 sign with fresh test keys."""
    desired = directory / "desired"
    shutil.copytree(source, desired)
    keys = {host: TestKey(host, f"{host}-test") for host in CANDIDATES}
    fleet_toml = desired / "fabric.toml"
    fleet_toml.write_text(with_plan_keys(fleet_toml.read_text(), list(keys.values())))
    return SignedFleet(desired, keys, directory / "keys")
