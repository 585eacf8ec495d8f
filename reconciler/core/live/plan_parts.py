"""The fleet plan in parts: a signed index and the parts it names (pure).

A plan of a large fleet does not fit one registry value (etcd refuses a
request over 1.5 MiB; 10,000 placements already take 0.9 MB), so the
registry stores it as

- the **index** (`PlanIndex`): the epoch, the leader, its term, the fleet
  and the registry prefix, when it was made, and the name and digest of each
  part; the leader's signature covers the index's canonical form
  (`canonical_index`), so it covers every part through its digest;
- the **parts**, each a canonical JSON value (`plan_parts`):

      fleet                 the lanes' views and phaze's steering
      host/<node>/<i>       the placements on one node, in chunks of `PART_ITEMS`
      deferred/<i>          the deferred replicas, in chunks of `PART_ITEMS`
      ignored/<i>           the undeclared nodes' names, in chunks of `NAMES_PER_PART`
      room/<i>              the come-home rule's memory (absent when empty)
      suspects/<i>          the leader's memory of suspected nodes (absent when empty)

A part is a function of the plan alone (no desired state): the same
placements give the same bytes and digest whatever the epoch, so a part that
did not change between two epochs is not written again (the registry keys a
part by its digest), and a host's part changing is seen from the index alone.

`join_plan` puts a plan back together from its index and parts and refuses,
naming the part, any part that is missing, whose digest is not the index's
(a part of another epoch, or tampered) or that does not parse: a reader never
takes a mix of two epochs. The plan it returns has its placements in the
scheduler's order: by service, replica, then a move's new placement after
the one it replaces (`normalized`);
`same_parts` compares two plans by their parts, whatever their order.

Canonical form: JSON with sorted keys, no whitespace, ASCII, every timestamp
in UTC with microseconds (`...Z`). Fields added since signing began are left
out while they hold their default (`room_since`, `suspects`, `Placement.replaces`,
`Placement.hedge`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from reconciler.core.live.models import FleetPlan, Placement, PlanSignature, _Live
from reconciler.core.timestamps import utc

# Placements or deferred replicas per part: a part of this many stays far
# under one etcd request (a placement is about 100 bytes).
PART_ITEMS = 2000
# Names of undeclared nodes, or come-home entries, per part.
NAMES_PER_PART = 4000

FLEET_PART = "fleet"


class PlanPartsError(Exception):
    """A plan's parts do not make its index's plan: the message names the part and why."""


class PlanIndex(_Live):
    """What the leader signs: the plan's identity and the digest of each part."""

    epoch: int = Field(ge=0, description="the registry's epoch counter when the plan was published")
    leader: str = Field(description="the leader candidate that published the plan")
    term: int = Field(default=0, ge=0, description="the leader's term as the registry assigned it")
    fleet: str = Field(default="", description="the fleet's name (fabric.toml [fleet] name)")
    prefix: str = Field(default="", description="the registry prefix the plan was published under")
    created: datetime = Field(description="when the leader made the plan")
    parts: dict[str, str] = Field(default_factory=dict, description="each part's name and the digest of its canonical bytes (`part_digest`)")
    signature: PlanSignature | None = Field(default=None, description="the leader's signature over `canonical_index` (None: unsigned)")

    def host_parts(self, node: str) -> list[str]:
        """The names of the parts holding `node`'s placements, in order."""
        return sorted((n for n in self.parts if n.startswith(f"host/{node}/")), key=_order)


def canonical_value(value: Any) -> Any:
    if isinstance(value, datetime):
        # Microseconds kept: the leader's `created` has them.
        return utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(value, dict):
        return {str(k): canonical_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical_value(v) for v in value]
    return value


def canonical_json(value: Any) -> bytes:
    return json.dumps(canonical_value(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def part_digest(data: bytes) -> str:
    """sha256 of a part's bytes, base64url without padding (43 characters)."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _placement(p: Placement) -> dict[str, Any]:
    body = p.model_dump(mode="python")
    for newer in ("replaces", "hedge"):  # newer fields, left out while unset
        if body.get(newer) is None:
            body.pop(newer, None)
    return body


def _chunks(items: list[Any], size: int) -> Iterable[tuple[int, list[Any]]]:
    for start in range(0, len(items), size):
        yield start // size, items[start : start + size]


def _placement_order(p: Placement) -> tuple[str, int, bool, str]:
    # A move's new placement after the one it replaces, as the scheduler puts them.
    return (p.service, p.replica, p.replaces is not None, p.node)


class PartsMemo:
    """A memo of the parts' canonical bytes and digests, handed in by a caller
    that makes the parts of many similar plans (the leader: several times a
    step, and each step's plan mostly the last one's): a chunk of placements,
    deferred replicas or names seen before (equal content: the models are
    frozen, compared field by field) gives its bytes again without being
    dumped, walked and encoded; bytes seen before give their digest again.
    The same content always gives the same bytes, so the parts made with a
    memo are those made without (`tests/unit/test_plan_parts_memo.py`).

    Bounded: two generations of at most `limit` entries and `byte_limit`
    bytes of parts each; when the newer is full it becomes the older and the
    oldest is forgotten (a plan's chunks, used at every step, move to the
    newer). The last few plans' parts are kept by identity (a frozen plan
    made once, compared, signed and stored)."""

    def __init__(self, limit: int = 50_000, byte_limit: int = 32 * 1024 * 1024) -> None:
        self.limit = limit
        self.byte_limit = byte_limit
        self._new: dict[Any, Any] = {}
        self._old: dict[Any, Any] = {}
        self._new_bytes = 0
        self._plans: list[tuple[FleetPlan, dict[str, bytes]]] = []
        self.hits = 0
        self.misses = 0

    def _get(self, key: Any) -> Any:
        found = self._new.get(key)
        if found is None:
            found = self._old.pop(key, None)
            if found is not None:
                self._put(key, found)
        return found

    def _put(self, key: Any, value: Any) -> None:
        if len(self._new) >= self.limit or self._new_bytes >= self.byte_limit:
            self._old, self._new, self._new_bytes = self._new, {}, 0
        self._new[key] = value
        # A chunk's bytes, or the bytes a digest is of (the same object, mostly: counted twice).
        self._new_bytes += len(value) if isinstance(value, bytes) else len(key) if isinstance(key, bytes) else 0

    def held_bytes(self) -> int:
        """The bytes of parts both generations hold (each object once)."""
        seen: dict[int, int] = {}
        for generation in (self._new, self._old):
            for key, value in generation.items():
                for item in (key, value):
                    if isinstance(item, bytes):
                        seen[id(item)] = len(item)
        return sum(seen.values())

    def chunk(self, kind: str, items: Sequence[Any], make: Callable[[], bytes]) -> bytes:
        """The bytes of a chunk of `kind` holding `items` (frozen models or
        text), made by `make` once. A model's key is its fields' values, in
        their order (plain values of fixed types: compared and hashed at C
        speed, unlike the models themselves)."""
        key = (kind, tuple(tuple(item.__dict__.values()) if isinstance(item, BaseModel) else item for item in items))
        found = self._get(key)
        if found is None:
            self.misses += 1
            found = make()
            self._put(key, found)
        else:
            self.hits += 1
        return found  # type: ignore[no-any-return]

    def digest(self, data: bytes) -> str:
        found = self._get(data)
        if found is None:
            found = part_digest(data)
            self._put(data, found)
        return found  # type: ignore[no-any-return]

    def parts_of(self, plan: FleetPlan) -> dict[str, bytes] | None:
        return next((parts for held, parts in self._plans if held is plan), None)

    def keep_parts(self, plan: FleetPlan, parts: dict[str, bytes]) -> None:
        self._plans = [(plan, parts), *self._plans[:3]]


def plan_parts(plan: FleetPlan, memo: PartsMemo | None = None) -> dict[str, bytes]:
    """Each part's name and canonical bytes (module docstring); with `memo`,
    the same bytes, those of chunks seen before taken from it."""
    if memo is not None:
        known = memo.parts_of(plan)
        if known is not None:
            return dict(known)
    parts: dict[str, bytes] = {
        FLEET_PART: canonical_json({"lanes": [v.model_dump(mode="python") for v in plan.lanes], "steering": plan.steering.model_dump(mode="python")})
    }
    by_node: dict[str, list[Placement]] = {}
    # In the scheduler's order (`normalized`), whatever the order given: a part is its content.
    for placement in sorted(plan.placements, key=_placement_order):
        by_node.setdefault(placement.node, []).append(placement)
    for node in sorted(by_node):
        for i, chunk in _chunks(by_node[node], PART_ITEMS):
            parts[f"host/{node}/{i}"] = _chunk_bytes(memo, "placements", chunk, _placement)
    deferred = sorted(plan.deferred, key=lambda d: (d.service, d.replica))
    for i, chunk in _chunks(deferred, PART_ITEMS):
        parts[f"deferred/{i}"] = _chunk_bytes(memo, "deferred", chunk, _dumped)
    for i, chunk in _chunks(list(plan.ignored_nodes), NAMES_PER_PART):
        parts[f"ignored/{i}"] = _chunk_bytes(memo, "ignored_nodes", chunk, str)
    for i, chunk in _chunks(sorted(plan.room_since.items()), NAMES_PER_PART):
        parts[f"room/{i}"] = canonical_json({"room_since": dict(chunk)})
    suspects = sorted((node, state.model_dump(mode="python")) for node, state in plan.suspects.items())
    for i, chunk in _chunks(suspects, NAMES_PER_PART):
        parts[f"suspects/{i}"] = canonical_json({"suspects": dict(chunk)})
    if memo is not None:
        memo.keep_parts(plan, dict(parts))
    return parts


def _dumped(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="python")


def _chunk_bytes(memo: PartsMemo | None, field: str, items: list[Any], dump: Callable[[Any], Any]) -> bytes:
    """The canonical bytes of {field: [each item dumped]}, from `memo` when it holds them."""

    def make() -> bytes:
        return canonical_json({field: [dump(item) for item in items]})

    return make() if memo is None else memo.chunk(field, items, make)


def plan_index(plan: FleetPlan, parts: Mapping[str, bytes] | None = None, memo: PartsMemo | None = None) -> PlanIndex:
    """The index of `plan` (its signature carried over), from its parts when given."""
    parts = plan_parts(plan, memo) if parts is None else parts
    digest = part_digest if memo is None else memo.digest
    return PlanIndex(
        epoch=plan.epoch,
        leader=plan.leader,
        term=plan.term,
        fleet=plan.fleet,
        prefix=plan.prefix,
        created=plan.created,
        parts={name: digest(data) for name, data in parts.items()},
        signature=plan.signature,
    )


def canonical_index(index: PlanIndex) -> bytes:
    """The bytes a plan's signature covers: its index without the signature.
    The parts (names and digests, text already: one per host of the fleet)
    are put in as they are, not walked by `canonical_value`: the same bytes
    at a tenth of the cost for a large fleet's index."""
    identity = canonical_value(index.model_dump(mode="python", exclude={"signature", "parts"}))
    # `canonical_json` without walking the parts again: the same arguments to json.dumps.
    body = {**identity, "parts": {str(name): digest for name, digest in index.parts.items()}}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _order(name: str) -> tuple[Any, ...]:
    """Parts in plan order: by kind, node, then chunk number (not as text: 10 after 9)."""
    kind, _, rest = name.partition("/")
    head, _, number = rest.rpartition("/") if kind == "host" else ("", "", rest)
    return (kind, head, int(number) if number.isdigit() else -1, number)


def _loaded(name: str, data: bytes, digest: str) -> dict[str, Any]:
    if part_digest(data) != digest:
        raise PlanPartsError(f"plan part {name}: its digest is not the index's (a part of another epoch, or tampered): refused")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise PlanPartsError(f"plan part {name}: not JSON ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise PlanPartsError(f"plan part {name}: not a JSON object")
    return body


def checked_part(index: PlanIndex, name: str, data: bytes | None) -> dict[str, Any]:
    """One part read on its own (a host reading only its part), checked against
    the index's digest; raises PlanPartsError naming it."""
    digest = index.parts.get(name)
    if digest is None:
        raise PlanPartsError(f"plan part {name} is not in the index of epoch {index.epoch}")
    if data is None:
        raise PlanPartsError(f"plan part {name} of epoch {index.epoch} is missing")
    return _loaded(name, data, digest)


def join_plan(index: PlanIndex, parts: Mapping[str, bytes], only: Collection[str] | None = None) -> FleetPlan:
    """The plan of `index` from `parts` (name -> bytes); raises PlanPartsError
    naming the first part that is missing, not the index's or unreadable.
    With `only`, the plan of those parts alone (a host's read, `PlanRead`):
    each must be the index's; what the others hold is left empty."""
    body: dict[str, Any] = {"placements": [], "deferred": [], "ignored_nodes": [], "room_since": {}, "suspects": {}}
    if only is not None:
        unknown = sorted(set(only) - set(index.parts))
        if unknown:
            raise PlanPartsError(f"plan part {unknown[0]} is not in the index of epoch {index.epoch}")
    for name in sorted(index.parts if only is None else set(only), key=_order):
        data = parts.get(name)
        if data is None:
            raise PlanPartsError(f"plan part {name} of epoch {index.epoch} is missing")
        part = _loaded(name, data, index.parts[name])
        kind = name.partition("/")[0]
        if name == FLEET_PART:
            body["lanes"] = part.get("lanes", [])
            body["steering"] = part.get("steering", {})
        elif kind == "host":
            body["placements"] += list(part.get("placements", []))
        elif kind == "deferred":
            body["deferred"] += list(part.get("deferred", []))
        elif kind == "ignored":
            body["ignored_nodes"] += list(part.get("ignored_nodes", []))
        elif kind == "room":
            body["room_since"].update(part.get("room_since", {}))
        elif kind == "suspects":
            body["suspects"].update(part.get("suspects", {}))
        else:
            raise PlanPartsError(f"plan part {name}: not a part this version knows (refused: it is signed, so a newer leader made it)")
    identity = index.model_dump(mode="python", exclude={"parts"})
    try:
        plan = FleetPlan.model_validate({**identity, **body})
    except ValidationError as exc:
        raise PlanPartsError(f"plan of epoch {index.epoch}: its parts do not make a plan ({exc.error_count()} errors)") from None
    return normalized(plan)


def normalized(plan: FleetPlan) -> FleetPlan:
    """`plan` as the registry gives it back: placements by service, replica, a
    move's new one after its old one, then node (the scheduler's own order);
    deferred replicas by service and replica."""
    return plan.model_copy(
        update={"placements": sorted(plan.placements, key=_placement_order), "deferred": sorted(plan.deferred, key=lambda d: (d.service, d.replica))}
    )


def same_parts(a: FleetPlan, b: FleetPlan, memo: PartsMemo | None = None) -> bool:
    """Equal parts: the same placements, deferred work, lanes, steering and memory."""
    return plan_parts(a, memo) == plan_parts(b, memo)


# -- a host's read: the index, and only the parts it needs (issue 34, item 2) --


@dataclass(frozen=True)
class PlanRead:
    """The newest plan as a host reads it: the signed index, and the plan of
    only the parts `parts` names (`join_plan(..., only=parts)`), each checked
    against the index's digest when read, all at the index's revision. The
    signature covers the index, so the fence verifies `index`
    (`signing.verify_index`) and that `plan` is the index's (`partial_problem`)."""

    index: PlanIndex
    plan: FleetPlan
    parts: tuple[str, ...]


def host_part_names(index: PlanIndex, host: str, *, fleet: bool = False) -> list[str]:
    """The parts a host's pass reads: its own placements (`host/<host>/<i>`)
    and, with `fleet` (a control host of a phaze fleet: the steering), the
    fleet part. A host with no placement reads none of its own."""
    names = index.host_parts(host)
    if fleet and FLEET_PART in index.parts:
        names.append(FLEET_PART)
    return names


def parts_version(digests: Mapping[str, str]) -> str:
    """One digest of some parts' names and digests (a host's, from its
    index: `glance_digests`): what the watcher follows for a host; equal
    whatever the epoch while those parts are the same."""
    return part_digest(canonical_json(sorted(digests.items())))


def own_digests(index: PlanIndex, host: str) -> dict[str, str]:
    """The names and digests of `host`'s parts in `index`."""
    return {name: index.parts[name] for name in index.host_parts(host)}


_DIGEST = rb'"([A-Za-z0-9_-]{43})"'


def glance_digests(index_bytes: bytes, host: str) -> tuple[int, dict[str, str]] | None:
    """The epoch of a stored index and the digests of `host`'s parts in it,
    found in its bytes without parsing the whole index (a regular expression
    at C speed: a large fleet's index is hundreds of kB, one entry per node),
    or None when they cannot be found that way (the caller parses it).
    Nothing is verified: what the watcher follows (`engine.watch`), whose
    pass then reads and verifies the plan; a forged index can at most start
    a pass that refuses it, or hold one back until the timer's."""
    epoch = re.match(rb'\{"epoch":(\d{1,19}),', index_bytes)
    if epoch is None or b'"parts":{' not in index_bytes:
        return None
    name = re.escape(f"host/{host}/".encode())
    found = {m.group(1).decode(): m.group(2).decode() for m in re.finditer(b'"(' + name + rb'\d{1,9})":' + _DIGEST, index_bytes)}
    return int(epoch.group(1)), found


_EMPTY_FLEET = canonical_json(
    {"lanes": [], "steering": FleetPlan(epoch=0, leader="", created=datetime(2000, 1, 1, tzinfo=UTC)).steering.model_dump(mode="python")}
)


def partial_problem(plan: FleetPlan, index: PlanIndex, host: str | None = None) -> str | None:
    """Why `plan` is not the plan of some of `index`'s parts, or None: its
    identity (epoch, leader, term, fleet, prefix, created, signature) is
    the index's, every part it makes is the index's to the byte (a node's
    placements all of that node's parts: none left out), the fleet part
    unless it is empty (not read), and, for `host`, every part the index
    names for it is there. What the fence checks of a host's read
    (`PlanRead`) beside the index's signature."""
    identity = index.model_dump(mode="python", exclude={"parts"})
    mine = plan.model_dump(mode="python", include=set(identity))
    if canonical_value(mine) != canonical_value(identity):
        return f"plan epoch {plan.epoch}: its identity is not its index's (epoch {index.epoch})"
    made = plan_parts(plan)
    if made.get(FLEET_PART) == _EMPTY_FLEET:
        made.pop(FLEET_PART)
    for name, data in made.items():
        if index.parts.get(name) != part_digest(data):
            return f"plan epoch {index.epoch}: part {name} is not the index's (tampered, or of another epoch)"
    nodes = {p.node for p in plan.placements} | ({host} if host is not None else set())
    for node in sorted(nodes):
        missing = [name for name in index.host_parts(node) if name not in made]
        if missing:
            return f"plan epoch {index.epoch}: part {missing[0]} of {node} was not read (a partial read)"
    return None
