"""A heartbeat as the registry stores it, on the record's JSON object (pure, standard library only).

The full pass measures and validates its record as a `NodeRecord`
(reconciler.core.live.records); a memoized pass re-sends the JSON that pass
left, with only what it measures afresh changed (the lane jobs in
`in_flight`), and builds no model. Both stamp the beat here and say the same note.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any


def beat_time(now: float) -> str:
    """`now` (seconds since the epoch) as pydantic writes an aware UTC datetime: `2026-12-01T01:22:42.123456Z`."""
    return datetime.fromtimestamp(now, tz=UTC).isoformat().replace("+00:00", "Z")


def stamped(record: Mapping[str, Any], *, now: float, ttl_s: float) -> dict[str, Any]:
    """`record` as stored by a beat at `now`, alive for `ttl_s` seconds."""
    return {**record, "beat_at": beat_time(now), "timeout_s": float(ttl_s)}


def heartbeat_note(node_id: str, tier: str, in_flight: int, timeout_s: float | None) -> str:
    """The pass's note on a beat stored with these fields."""
    timeout = f", alive for {timeout_s:g} s" if timeout_s is not None else ""
    return f"heartbeat: {node_id} tier {tier}, in_flight {in_flight}{timeout}"
