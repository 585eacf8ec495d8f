"""The `PlanSigner` port over a private key file, and `fabric leader keygen`'s key file.

The key file is an unencrypted PKCS#8 PEM ed25519 private key, as
`fabric leader keygen --out FILE` writes it (or `openssl genpkey -algorithm
ed25519`). It lives only on its leader candidate, readable by root alone:
a key file owned by another user, or open to its group or others, is refused
(reconciler.adapters.secret_files), as ssh refuses one.
The key is read when first needed, so a host that never leads never needs
the file. Messages name the file, never its content.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from reconciler.adapters.secret_files import SecretFileRefused, read_secret_file
from reconciler.ports import PlanSigningError


def _public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)


class KeyFileSigner:
    """Signs with the ed25519 key in `path`."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._key: Ed25519PrivateKey | None = None

    def describe(self) -> str:
        return f"plan signing key {self.path}"

    def _load(self) -> Ed25519PrivateKey:
        if self._key is not None:
            return self._key
        try:
            # Not through a symbolic link: the key file itself is checked and read.
            data = read_secret_file(self.path, "the plan signing key", follow_symlinks=False)
        except SecretFileRefused as exc:
            raise PlanSigningError(str(exc)) from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            # The exception's text could quote the file: say only what it is not.
            raise PlanSigningError(f"{self.path}: not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise PlanSigningError(f"{self.path}: not an ed25519 private key")
        self._key = key
        return key

    def public_key(self) -> bytes:
        return _public_bytes(self._load())

    def sign(self, message: bytes) -> bytes:
        return self._load().sign(message)


def generate_key_file(path: Path | str) -> bytes:
    """Write a new ed25519 private key to `path` (mode 0600, created, never
    overwritten) and return its raw public key. Raises PlanSigningError."""
    path = Path(path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )
    try:
        # O_EXCL: refuse to overwrite (a candidate's key is not replaced by accident);
        # mode 0600 from creation on, so the key is never readable by others.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise PlanSigningError(f"{path}: already exists; not overwriting a key (remove it first if you mean to)") from None
    except OSError as exc:
        raise PlanSigningError(f"{path}: cannot create: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    return _public_bytes(key)
