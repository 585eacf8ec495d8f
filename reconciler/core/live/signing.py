"""Signed fleet plans (pure): the canonical form a leader signs, and the check every host makes.

Without signatures any registry client could write a plan naming a leader
candidate and a higher epoch, and every host would apply it. With plan keys
in fabric.toml (`[[plan_keys]] host, id, public_key`), the leader signs the
canonical form of each plan it publishes with its private key (which never
leaves the candidate: `reconciler.adapters.plan_signing`), and a host
applies a registry plan only if `verify_plan` finds no fault with it:

    signed  = with_signature(plan, key.id, signer.sign(canonical_plan(plan)))
    problem = verify_plan(plan, desired.fleet.plan_keys)   # None: valid

The canonical form is the plan's index (`plan_parts.canonical_index`): its
identity and the digest of each part, every part canonical JSON with sorted
keys, no whitespace and every timestamp in UTC (`...Z`), so the same plan
read back from etcd, sqlite or a file, whatever its key order or time zone,
gives the same bytes, and the signature covers each part through its digest.
A field added since (`room_since`, `Placement.replaces`) is left out of its
part while unset. Hosts of a version that signed the whole plan instead
(before the plan in parts) refuse these plans and stay static until they are
upgraded, never the reverse.

Verification needs only the public key and no I/O; signing needs the private
key and so happens behind the `PlanSigner` port.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import FleetPlan, PlanSignature
from reconciler.core.live.plan_parts import PartsMemo, PlanIndex, canonical_index, plan_index


def canonical_plan(plan: FleetPlan, memo: PartsMemo | None = None) -> bytes:
    """The bytes a plan's signature covers: the canonical form of its index
    (`reconciler.core.live.plan_parts`): its epoch, leader, term, fleet,
    prefix and creation time, and the digest of each of its parts' canonical
    bytes, so the signature covers every field but itself, and a host that
    holds the index and one part checks that part by its digest alone."""
    return canonical_index(plan_index(plan, memo=memo))


def with_signature(plan: FleetPlan, key_id: str, signature: bytes) -> FleetPlan:
    return plan.model_copy(update={"signature": PlanSignature(key_id=key_id, value=base64.b64encode(signature).decode())})


def listed_key(keys: Sequence[PlanKey], host: str, public_key: bytes) -> PlanKey | None:
    """The plan key of `host` whose public key is `public_key` (how a signer
    finds the id to sign under), or None when fabric.toml does not list it."""
    return next((key for key in keys if key.host == host and key.public_bytes() == public_key), None)


def verify_plan(plan: FleetPlan, keys: Sequence[PlanKey], memo: PartsMemo | None = None) -> str | None:
    """Why `plan` must not be applied under the plan keys `keys`, or None when
    it is signed, by a listed key of the host it names as leader, and the
    signature matches its canonical form. The caller checks that the leader
    is a candidate (fabric.toml lists keys for candidates only)."""
    return verify_index(plan_index(plan, memo=memo), keys)


def verify_index(index: PlanIndex, keys: Sequence[PlanKey]) -> str | None:
    """`verify_plan` of the plan `index` names, from its index alone: a reader
    that then checks each part it reads against the index's digest
    (`plan_parts.join_plan`, `plan_parts.checked_part`) reads only signed bytes."""
    signature = index.signature
    if signature is None:
        return f"plan epoch {index.epoch} is not signed, and fabric.toml lists plan keys"
    key = next((k for k in keys if k.id == signature.key_id), None)
    if key is None:
        return f"plan epoch {index.epoch} is signed by key {signature.key_id!r}, which fabric.toml does not list (unknown or retired)"
    if key.host != index.leader:
        return f"plan epoch {index.epoch} names {index.leader!r} as leader but is signed by {key.host!r}'s key {key.id!r}"
    try:
        raw = base64.b64decode(signature.value, validate=True)
        Ed25519PublicKey.from_public_bytes(key.public_bytes()).verify(raw, canonical_index(index))
    except (InvalidSignature, binascii.Error, ValueError):
        return f"plan epoch {index.epoch} has a signature that does not match its content under {key.host!r}'s key {key.id!r} (tampered or forged)"
    return None
