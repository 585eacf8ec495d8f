"""Parsing what the registry holds, one record at a time, never trusting its bytes.

Any member may be hostile or broken: x86-spill's own etcd identity may write
anything into P/nodes/x86-spill and P/facts/x86-spill (random bytes, JSON of
the wrong shape, nesting thousands deep, megabytes). Both backends parse every
record they read through `parse_record`: a record that does not parse or
validate gives an `UnreadableRecord` (what it is, which key, a short reason
that never quotes its bytes) instead of an exception, so the read skips it and
goes on. A read that needs one record and cannot do without it (the plan, the
leader) raises the port's own `RegistryError` through `require`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from reconciler.core.live.members import MemberRecord
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.pending import PendingRecord
from reconciler.core.live.plan_parts import (
    PartsMemo,
    PlanIndex,
    PlanPartsError,
    PlanRead,
    glance_digests,
    join_plan,
    normalized,
    own_digests,
    plan_index,
    plan_parts,
)
from reconciler.core.live.unreadable import MAX_REASON_CHARS, UnreadableRecord
from reconciler.ports import RegistryError

Model = TypeVar("Model", bound=BaseModel)

# A model's field name, as a problem may say it; any other key of the record
# (a label's, a unit's) is the host's bytes and is shown as `[...]`.
_FIELD = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

# The largest value a record may be. A node's record or state is a few KiB
# (50 transitions at most); the plan is bounded by one etcd request.
MAX_RECORD_BYTES = 256 * 1024
MAX_PLAN_BYTES = 2 * 1024 * 1024
# The keys (etcd, under the prefix) and names of the plan in parts: the signed
# index, and each part under its digest.
PLAN_INDEX = "plan-index"
PLAN_PARTS = "plan-parts"

# What each kind of key holds, as a problem names it.
WHAT = {
    "nodes": "heartbeat record",
    "facts": "heartbeat record",
    "state": "node state",
    "node_states": "node state",
    "drain": "drain request",
    "drains": "drain request",
    "plan": "plan",
    "plan-index": "plan",
    "plan-parts": "plan part",
    "leader": "leader record",
    "scaling": "scaling record",
    "epoch": "epoch",
    "pending": "pending report",
    "members": "member report",
}


def _printable(text: str) -> str:
    """`text` with control characters replaced and cut to MAX_REASON_CHARS."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= MAX_REASON_CHARS else clean[: MAX_REASON_CHARS - 3] + "..."


def _where(loc: tuple[int | str, ...]) -> str:
    """('labels', 'k', 0) -> 'labels[...][0]': field names, list positions, and no key the record chose."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD.match(part):
            out += f".{part}" if out else part
        else:
            out += "[...]"
    return out or "(top level)"


def validation_reason(exc: ValidationError) -> str:
    """The first error of `exc` as `key.path: message` (pydantic's own str()
    quotes the input: never used), and how many more there are."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if not errors:
        return "does not validate"
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = f"not JSON ({first['msg'].removeprefix('Invalid JSON: ')})"
    else:
        where = _where(first.get("loc", ()))
        reason = f"{where}: {first['msg']}" if where else str(first["msg"])
    more = len(errors) - 1
    return reason + (f" (and {more} more)" if more else "")


def parse_record(
    model: type[Model],
    value: object,
    *,
    key: str,
    node: str | None = None,
    limit: int = MAX_RECORD_BYTES,
) -> tuple[Model | None, UnreadableRecord | None]:
    """`value` as `model`, or None and why not. Never raises: whatever the
    bytes (not UTF-8, not JSON, the wrong shape, too deep, too big; in sqlite
    not even text)."""
    kind = key.split("/", 1)[0]
    what = WHAT.get(kind, "record")
    if not isinstance(value, bytes | str):
        return None, UnreadableRecord(key=key, node=node, what=what, reason=f"not text ({type(value).__name__})")
    size = len(value)
    if size > limit:
        return None, UnreadableRecord(key=key, node=node, what=what, reason=f"{size} bytes, over the {limit}-byte limit")
    if not size:
        return None, UnreadableRecord(key=key, node=node, what=what, reason="empty")
    try:
        return model.model_validate_json(value), None
    except ValidationError as exc:
        reason = validation_reason(exc)
    except (ValueError, TypeError, OverflowError, RecursionError, UnicodeError) as exc:
        # pydantic wraps a validator's ValueError; these are what it does not.
        reason = f"does not parse ({type(exc).__name__})"
    return None, UnreadableRecord(key=key, node=node, what=what, reason=_printable(reason))


Report = TypeVar("Report", PendingRecord, MemberRecord)


def renewed_report(record: Report, earlier: object | None, *, key: str, node: str, now: datetime, ttl_s: float, what: str) -> tuple[Report, bytes]:
    """A pending or member report as a backend stores it (and its bytes):
    stamped `now` with its TTL, keeping the first_seen of the `earlier`
    stored value it replaces (None: the first report; unreadable: starts
    again). RegistryError when it is over the record size limit."""
    replaced, _ = parse_record(type(record), earlier, key=key, node=node) if earlier is not None else (None, None)
    first = replaced.first_seen if replaced is not None and replaced.first_seen is not None else now
    stored = record.model_copy(update={"first_seen": first, "reported_at": now, "timeout_s": float(ttl_s)})
    value = stored.model_dump_json().encode()
    if len(value) > MAX_RECORD_BYTES:
        raise RegistryError(f"{what}: {len(value)} bytes, over the {MAX_RECORD_BYTES}-byte limit")
    return stored, value


def parse_int(value: bytes | str, *, key: str) -> tuple[int | None, UnreadableRecord | None]:
    """A decimal counter (etcd's P/epoch), or None and why not."""
    text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
    if 0 < len(text) <= 20 and text.isascii() and text.isdigit():
        return int(text), None
    return None, UnreadableRecord(key=key, what=WHAT.get(key, "record"), reason="not a decimal number")


def require(parsed: tuple[Model | None, UnreadableRecord | None], where: str) -> Model:
    """The parsed record, or `RegistryError` naming it (`where`: the backend
    and key, e.g. "etcd /fabric/plan")."""
    model, problem = parsed
    if model is None:
        assert problem is not None
        raise RegistryError(f"{where}: unreadable {problem.what}: {problem.reason}")
    return model


def key_text(raw: bytes) -> str:
    """A key's bytes as text, whatever they are."""
    return raw.decode("utf-8", errors="replace")


# -- the plan in parts (reconciler.core.live.plan_parts), as both backends store it ------


@dataclass(frozen=True)
class StoredPlan:
    """A plan as a backend writes it: its index's bytes and its parts' bytes
    by digest (a part's key: the same bytes, the same key, whatever the epoch)."""

    plan: FleetPlan
    index: PlanIndex
    index_bytes: bytes
    parts: dict[str, bytes]


def stored_plan(plan: FleetPlan, *, budget: int, memo: PartsMemo | None = None) -> StoredPlan:
    """`plan` (numbered and signed) cut into its index and parts; raises
    RegistryError when the index or a part is over `budget` bytes (one
    request's). `memo`: the chunks' bytes and digests made before (`PartsMemo`)."""
    named = plan_parts(plan, memo)
    index = plan_index(plan, named, memo)
    index_bytes = index.model_dump_json().encode()
    if len(index_bytes) > budget:
        raise RegistryError(f"the plan's index is {len(index_bytes)} bytes ({len(index.parts)} parts), over the {budget}-byte budget of one request")
    parts: dict[str, bytes] = {}
    for name, data in named.items():
        if len(data) > budget:
            raise RegistryError(f"the plan's part {name} is {len(data)} bytes, over the {budget}-byte budget of one request")
        parts[index.parts[name]] = data
    return StoredPlan(plan=normalized(plan), index=index, index_bytes=index_bytes, parts=parts)


def read_plan(
    index_bytes: bytes | str, part_of: Callable[[str], bytes | str | None], *, where: str
) -> tuple[FleetPlan | None, UnreadableRecord | None]:
    """The plan of the index `index_bytes`, its parts read by digest through
    `part_of` (from the same instant: one revision, one transaction), or None
    and why not: an index that does not parse, a part that is missing, not
    the index's (another epoch's, or tampered) or unreadable, named."""
    index, problem = parse_record(PlanIndex, index_bytes, key=PLAN_INDEX, limit=MAX_PLAN_BYTES)
    if index is None:
        return None, problem
    named: dict[str, bytes] = {}
    for name, digest in index.parts.items():
        data = part_of(digest)
        if data is not None:
            named[name] = data.encode() if isinstance(data, str) else data
    try:
        return join_plan(index, named), None
    except PlanPartsError as exc:
        return None, UnreadableRecord(key=PLAN_INDEX, what="plan", reason=_printable(f"{where}: {exc}"))


def read_index(index_bytes: bytes | str, *, where: str) -> PlanIndex:
    """The plan's index, or RegistryError naming `where` and why it does not parse."""
    return require(parse_record(PlanIndex, index_bytes, key=PLAN_INDEX, limit=MAX_PLAN_BYTES), where)


def plan_read_of(index: PlanIndex, names: Collection[str], part_of: Callable[[str], bytes | str | None], *, where: str) -> PlanRead:
    """A host's read (`PlanRead`): the plan of the parts `names` of `index`,
    each read by digest through `part_of` (from the index's instant) and
    checked against the index's digest; RegistryError naming the part that
    is not in the index, missing, not the index's or unreadable."""
    named: dict[str, bytes] = {}
    for name in names:
        digest = index.parts.get(name)
        data = part_of(digest) if digest is not None else None
        if data is not None:
            named[name] = data.encode() if isinstance(data, str) else data
    try:
        plan = join_plan(index, named, only=names)
    except PlanPartsError as exc:
        raise RegistryError(_printable(f"{where}: unreadable plan: {exc}")) from None
    return PlanRead(index=index, plan=plan, parts=tuple(sorted(names)))


def glance_of(index_bytes: bytes | str, host: str, *, where: str) -> tuple[int, dict[str, str]]:
    """`PlanReads.plan_glance` from the stored index: found in its bytes
    (`glance_digests`), else parsed (RegistryError when it does not parse)."""
    raw = index_bytes.encode() if isinstance(index_bytes, str) else index_bytes
    found = glance_digests(raw, host) if isinstance(raw, bytes) else None
    if found is not None:
        return found
    index = read_index(index_bytes, where=where)
    return index.epoch, own_digests(index, host)


def member_records(entries: list[tuple[str, object]]) -> tuple[list[MemberRecord], list[str]]:
    """Each member report (its key's tail `<group>/<member>`, its value)
    parsed on its own: one that does not parse, or whose group or name is not
    its key's (a group identity writing as another group), is skipped and named."""
    records: list[MemberRecord] = []
    problems: list[str] = []
    for tail, raw in entries:
        key = f"members/{tail}"
        group, _, node = tail.partition("/")
        parsed, problem = parse_record(MemberRecord, raw, key=key, node=node or None)
        if parsed is not None and (parsed.group, parsed.node_id) != (group, node):
            problem = UnreadableRecord(
                key=key, node=node or None, what=WHAT["members"], reason=f"names another group or member ({parsed.group}/{parsed.node_id})"
            )
            parsed = None
        if parsed is not None:
            records.append(parsed)
        elif problem is not None:
            problems.append(problem.line())
    return records, problems
