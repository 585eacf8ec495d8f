"""sha256 for the memoized pass, without OpenSSL's start-up.

`hashlib` loads OpenSSL (`_hashlib`) when imported, a few milliseconds of
every memo hit, which needs sha256 alone (its key, the installed files'
hashes, the probe's input stamps). CPython's own sha256 (`_sha256` in 3.11,
`_sha2` from 3.12) gives the same digests; anything else uses hashlib's.
"""

from __future__ import annotations

try:
    from _sha256 import sha256  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - another interpreter
    try:
        from _sha2 import sha256  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        from hashlib import sha256  # type: ignore[assignment,unused-ignore]

__all__ = ["sha256"]
