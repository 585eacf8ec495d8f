"""The pass memo: what lets an unchanged pass skip loading, rendering and planning.

Every host runs a pass every 30 s and almost every pass finds nothing to do.
A pass that ends with the world as the desired state wants it (outcome noop,
applied or written) leaves a memo in the state directory:

    key           the digest of the pass's inputs: the desired-state tree, the
                  probe, the plan file or capture, the options, this program's version
    desired_files the host files beside its own the pass's artifacts depend
                  on: a plain directory's key stats them
    generation    the generation that was current
    files         every installed file of that generation and its sha256
    units         each unit of the generation and its state after the pass (with activation)
    nft           the sha256 of `nft list table inet fabric` after the pass (with activation)
    node_record   the heartbeat this host sent after activation (JSON, validated
                  as that pass measured it), re-sent with the lane jobs counted afresh
    registry      how to reach the registry (fabric.toml's [registry], [timing]
                  and [flap], validated), and beat_ttl_s the heartbeat's TTL:
                  fabric.toml is part of the key, so they hold while the memo does
    load_services the placed service units running (the rest of in_flight
                  but the lane jobs: the drift check keeps it true)
    lanes_here    the lanes whose jobs run here: their jobs start and end
                  without any drift, so each memoized pass reads them
    lane_queues   each of those lanes' queue on phaze's broker, and lane_broker
                  how to reach the broker ([phaze] queue_url_file, None when
                  not configured, and job_function): fabric.toml's, part of
                  the key, so a memoized pass validates no fabric.toml for them
    epoch         the registry's plan epoch the pass saw (None: no registry)
    probe_reuse   of each probe command that declares its inputs (lspci,
                  lsblk, ffmpeg: core.probe.facts.Inputs), the stamp of those
                  inputs as the pass's probe ran it, and what it printed: a
                  memoized pass within MAX_AGE_S takes that text instead of
                  running the command while the stamp is the same

The next pass computes the key of its own inputs first; when the key is the
memo's, the memo is younger than MAX_AGE_S, the registry's epoch is the
memo's (read before the world is looked at: a new plan makes the full pass
at once) and the world has not drifted (`drift`: a file edited or removed, a
unit no longer in its state, the table changed or flushed), the pass builds
no model and renders nothing: it sends its heartbeat, writes its one audit
line and stops. Anything else (no memo, a corrupt one, any input, a new
epoch or any drift) is a full pass, which repairs the drift and writes a new
memo.

This module is pure: the reads go through the callables the caller hands in.
It imports nothing but the standard library (and reconciler.digests: its
sha256 without OpenSSL), so the memoized pass pays for
no model or template.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from reconciler.digests import sha256 as _sha256

MEMO_FILE = "pass-memo.json"
MEMO_VERSION = 7
# A memoized pass refreshes this host's pass series in the metrics textfile
# (duration, success, last success) but leaves the fleet's (the edge's status
# page, the fleet series from the registry's snapshot) as the last full pass
# wrote them: a full pass at least this often keeps them fresh. A host that
# shows the fleet (it read a snapshot) does one within the node timeout, so
# its page is never staler than a node takes to go offline.
MAX_AGE_S = 300.0
# drift's answer when only the table differs: the full pass must load it again
# (it is still loaded, so the plan alone would not).
NFT_DRIFT = "the nftables table changed"


@dataclass(frozen=True)
class MemoSeed:
    """What a pass that left the world as the desired state wants it knows,
    for the memo (the full pass's report carries it; `memo_after` adds what
    the world holds then): the files it installed, the units to watch, the
    heartbeat it sent and the registry epoch it saw."""

    generation: int | None
    files: tuple[str, ...]  # every installed file of that generation
    units: tuple[str, ...]  # each unit of the generation
    node_record: str | None  # the heartbeat's record, JSON; None: no registry
    registry_epoch: int | None
    # A leader candidate's pass may lead: it is never memoized.
    may_lead: bool
    # The pass showed the fleet (an edge's status page and fleet metrics from
    # the registry's snapshot): how stale that view may grow (the node timeout).
    fleet_view_max_age_s: float | None = None
    # The heartbeat's load apart from the lane jobs (running service units),
    # and the lanes whose jobs a memoized pass reads afresh.
    load_services: int = 0
    lanes_here: tuple[str, ...] = ()
    # Their queues on phaze's broker, and how to reach it (fabric.toml's
    # [phaze] queue_url_file and job_function), so that a memoized pass reads
    # their jobs without loading fabric.toml.
    lane_queues: dict[str, str] = field(default_factory=dict)
    lane_broker: dict[str, Any] | None = None
    # How a memoized pass reaches the registry without loading fabric.toml
    # (its [registry], [timing] and [flap], validated) and the heartbeat's TTL.
    registry: dict[str, Any] | None = None
    beat_ttl_s: float | None = None
    # The host files (relative to the desired-state directory) this pass's
    # artifacts depend on beside fabric.toml and its own: the hosts it names
    # (control, lanes, leader candidates, port-map targets) and, on the
    # edge, its routed services' nodes. A plain directory's key stats them
    # (memoized_pass.desired_digest), so one of them edited in place is seen.
    desired_files: tuple[str, ...] = ()

    @property
    def max_age_s(self) -> float:
        """How long a memo of this pass may stand for the next ones."""
        return min(MAX_AGE_S, self.fleet_view_max_age_s or MAX_AGE_S)


@dataclass(frozen=True)
class PassMemo:
    """The seed of a converged pass, with the world as that pass left it."""

    key: str
    written_at: float
    seed: MemoSeed
    file_digests: Mapping[str, str] = field(default_factory=dict)  # seed.files' sha256
    unit_states: Mapping[str, str] = field(default_factory=dict)  # seed.units' ActiveState (with activation)
    nft: str | None = None
    # raw name -> {"stamp", "output", "error"} (engine.probe.LiveProbe.reusable)
    probe_reuse: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"version": MEMO_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PassMemo:
        """Raises ValueError for anything but a memo of this version."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.pop("version", None) != MEMO_VERSION or not isinstance(data.get("seed"), dict):
                raise ValueError("not a pass memo of this version")
            seed = data.pop("seed")
            seed = MemoSeed(
                **{
                    **seed,
                    "files": tuple(seed.get("files") or ()),
                    "units": tuple(seed.get("units") or ()),
                    "lanes_here": tuple(seed.get("lanes_here") or ()),
                    "desired_files": tuple(seed.get("desired_files") or ()),
                }
            )
            memo = cls(seed=seed, **data)
        except (TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a pass memo: {exc}") from None
        if not _well_formed(memo):
            raise ValueError("not a pass memo: malformed fields")
        return memo


def _well_formed(memo: PassMemo) -> bool:
    seed = memo.seed
    return (
        isinstance(memo.key, str)
        and isinstance(memo.written_at, int | float)
        and isinstance(memo.file_digests, dict)
        and isinstance(memo.unit_states, dict)
        and isinstance(seed.generation, int | None)
        and isinstance(seed.node_record, str | None)
        and isinstance(seed.registry_epoch, int | None)
        and isinstance(seed.registry, dict | None)
        and isinstance(seed.beat_ttl_s, int | float | None)
        and isinstance(seed.fleet_view_max_age_s, int | float | None)
        and isinstance(seed.load_services, int)
        and all(isinstance(lane, str) for lane in seed.lanes_here)
        and isinstance(seed.lane_queues, dict)
        and all(isinstance(queue, str) for queue in seed.lane_queues.values())
        and isinstance(seed.lane_broker, dict | None)
        and all(isinstance(name, str) for name in seed.desired_files)
        and isinstance(memo.probe_reuse, dict)
        and all(isinstance(entry, dict) and isinstance(entry.get("stamp"), str) for entry in memo.probe_reuse.values())
    )


def inputs_key(parts: Mapping[str, str | None]) -> str:
    """One digest of the named inputs of a pass."""
    return _sha256(json.dumps(dict(parts), sort_keys=True).encode()).hexdigest()


def sha256(data: bytes) -> str:
    return _sha256(data).hexdigest()


# Reads of the world a memo is checked against.
ReadFile = Callable[[str], bytes | None]  # a file under the root, None when it is not there
UnitState = Callable[[str], str]  # a unit's ActiveState
NftDigest = Callable[[], str | None]  # sha256 of the fabric table's listing, None when it is not loaded


def usable(memo: PassMemo | None, key: str, now: float) -> str | None:
    """Why `memo` cannot stand for this pass (None: it can, if the world has not drifted)."""
    if memo is None:
        return "no memo"
    if memo.key != key:
        return "the inputs changed"
    if not fresh(memo, now):
        return "the memo is too old"
    return None


def fresh(memo: PassMemo, now: float) -> bool:
    """Whether `memo` is young enough to stand for a pass at `now` (and its
    probe's outputs to be reused: a memo too old makes a full pass, which runs
    every probe command)."""
    return 0 <= now - memo.written_at <= memo.seed.max_age_s


def drift(memo: PassMemo, read: ReadFile, unit_state: UnitState | None, nft_digest: NftDigest | None) -> str | None:
    """The first difference between the world and what the memo's pass left, or None."""
    for path, digest in memo.file_digests.items():
        data = read(path)
        if data is None:
            return f"{path} is missing"
        if sha256(data) != digest:
            return f"{path} was changed"
    if unit_state is not None:
        for unit, state in memo.unit_states.items():
            now = unit_state(unit)
            if now != state:
                return f"{unit} is {now}, was {state}"
    if nft_digest is not None and memo.nft is not None and nft_digest() != memo.nft:
        return NFT_DRIFT
    return None


# This host's pass series in the metrics textfile (reconciler.core.views.metrics
# names them; tests/unit/test_pass_memo.py renders the real file and checks).
DURATION_SERIES = "fabric_reconcile_duration_seconds"
SUCCESS_SERIES = "fabric_reconcile_success"
LAST_SUCCESS_SERIES = "fabric_reconcile_last_success_timestamp_seconds"


def refreshed_metrics(text: str, *, duration_s: float, now: float) -> str:
    """The textfile with this host's pass series as a successful pass of
    `duration_s` ending at `now` leaves them; every other line as it was."""
    values = {DURATION_SERIES: repr(duration_s), SUCCESS_SERIES: "1", LAST_SUCCESS_SERIES: repr(now)}
    for name, value in values.items():
        if text.startswith(f"{name} "):
            start = 0
        else:
            found = text.find(f"\n{name} ")
            if found < 0:
                continue  # not there: nothing to refresh
            start = found + 1
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        text = f"{text[:start]}{name} {value}{text[end:]}"
    return text
