"""Signed fleet plans (pure): the canonical form a leader signs, and the check every host makes.

Without signatures any registry client could write a plan naming a leader
candidate and a higher epoch, and every host would apply it. With plan keys
in fabric.toml (`[[plan_keys]] host, id, public_key`), the leader signs the
canonical form of each plan it publishes with its private key (which never
leaves the candidate: `reconciler.adapters.plan_signing`), and a host
applies a registry plan only if `verify_plan` finds no fault with it:

    signed  = with_signature(plan, key.id, signer.sign(canonical_plan(plan)))
    problem = verify_plan(plan, desired.fleet.plan_keys)   # None: valid

The canonical form is the plan without its signature as JSON with sorted
keys, no whitespace and every timestamp in UTC (`...Z`), so the same plan
read back from etcd, sqlite or a file, whatever its key order or time zone,
gives the same bytes. A field an older host does not know is not part of its
canonical form, so a plan with new fields verifies only on hosts that know
them: those hosts stay static until they are upgraded, never the reverse.

Verification needs only the public key and no I/O; signing needs the private
key and so happens behind the `PlanSigner` port.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import FleetPlan, PlanSignature
from reconciler.core.timestamps import utc


def _canonical_value(value: Any) -> Any:
    if isinstance(value, datetime):
        # Microseconds kept: the leader's `created` has them.
        return utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(value, dict):
        return {str(k): _canonical_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical_value(v) for v in value]
    return value


# Fields added since signing began, left out of the canonical form while they
# hold their default: a plan that does not use them signs and verifies the
# same on hosts that know them and hosts that do not (issue 32's come-home
# moves: `room_since`, `Placement.replaces`; issue 30's hedges: `suspects`,
# `Placement.hedge`).
_NEWER_PLAN_FIELDS: dict[str, Any] = {"room_since": {}, "suspects": {}}
_NEWER_PLACEMENT_FIELDS: dict[str, Any] = {"replaces": None, "hedge": None}


def _drop_unset_newer_fields(body: dict[str, Any]) -> None:
    for key, default in _NEWER_PLAN_FIELDS.items():
        if body.get(key, default) == default:
            body.pop(key, None)
    for placement in body.get("placements", []):
        for key, default in _NEWER_PLACEMENT_FIELDS.items():
            if placement.get(key, default) == default:
                placement.pop(key, None)


def canonical_plan(plan: FleetPlan) -> bytes:
    """The bytes a plan's signature covers: every field but the signature."""
    body = _canonical_value(plan.model_dump(mode="python", exclude={"signature"}))
    _drop_unset_newer_fields(body)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def with_signature(plan: FleetPlan, key_id: str, signature: bytes) -> FleetPlan:
    return plan.model_copy(update={"signature": PlanSignature(key_id=key_id, value=base64.b64encode(signature).decode())})


def listed_key(keys: Sequence[PlanKey], host: str, public_key: bytes) -> PlanKey | None:
    """The plan key of `host` whose public key is `public_key` (how a signer
    finds the id to sign under), or None when fabric.toml does not list it."""
    return next((key for key in keys if key.host == host and key.public_bytes() == public_key), None)


def verify_plan(plan: FleetPlan, keys: Sequence[PlanKey]) -> str | None:
    """Why `plan` must not be applied under the plan keys `keys`, or None when
    it is signed, by a listed key of the host it names as leader, and the
    signature matches its canonical form. The caller checks that the leader
    is a candidate (fabric.toml lists keys for candidates only)."""
    signature = plan.signature
    if signature is None:
        return f"plan epoch {plan.epoch} is not signed, and fabric.toml lists plan keys"
    key = next((k for k in keys if k.id == signature.key_id), None)
    if key is None:
        return f"plan epoch {plan.epoch} is signed by key {signature.key_id!r}, which fabric.toml does not list (unknown or retired)"
    if key.host != plan.leader:
        return f"plan epoch {plan.epoch} names {plan.leader!r} as leader but is signed by {key.host!r}'s key {key.id!r}"
    try:
        raw = base64.b64decode(signature.value, validate=True)
        Ed25519PublicKey.from_public_bytes(key.public_bytes()).verify(raw, canonical_plan(plan))
    except (InvalidSignature, binascii.Error, ValueError):
        return f"plan epoch {plan.epoch} has a signature that does not match its content under {key.host!r}'s key {key.id!r} (tampered or forged)"
    return None
