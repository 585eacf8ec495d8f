"""The edge's Caddy as a source of suspicion (issue 30, item 2). Pure.

The edge host reads its Caddy's upstreams (admin API `GET
/reverse_proxy/upstreams`: each upstream's `address`, `num_requests` and
`fails`, the failures Caddy's passive health checks remember for the
snippet's `fail_duration`) and writes them under its own registry identity
as one record, `P/edge-upstreams/<edge host>` (`EdgeUpstreams`). The leader
reads every such record and counts "the edge sees every upstream of host X
failing" as one source (`edge_failing`): with another agreeing source (Ray,
tailscale) it makes X suspected (`suspicion.suspected`); alone it does not.

- `caddy_upstreams(payload)`: the admin API's answer as `Upstream`s; an
  answer of another shape is a ValueError naming what is wrong.
- `edge_records(raw, edges)`: each stored record parsed on its own; one that
  does not parse, names another host than its key, or comes from a host
  that is not an edge is skipped and named (`EdgeRecordProblem`), never
  breaking the others or the leader.
- `edge_failing(records, addresses, now, max_age_s)`: host -> what the edge
  says, for each host whose every upstream on the edge fails (at least one
  upstream, each with fails > 0) in a record younger than `max_age_s`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reconciler.core.timestamps import utc

# The name of this source in a suspicion's reasons ("edge: ...").
SOURCE = "edge"
# The biggest record the leader reads (a small fleet's upstreams: a few KiB).
MAX_RECORD_BYTES = 64 * 1024


class Upstream(BaseModel):
    """One upstream as Caddy's admin API shows it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    address: str = Field(min_length=1, description="The upstream's dial address as the Caddyfile names it (host:port).")
    num_requests: int = Field(default=0, ge=0, description="Requests in flight to it now.")
    fails: int = Field(default=0, ge=0, description="Failed requests Caddy remembers for fail_duration (passive health checks).")

    @property
    def host(self) -> str:
        """The address without its port ("[::1]:80" -> "::1")."""
        host, _, port = self.address.rpartition(":")
        return (host if port.isdigit() and host else self.address).strip("[]")


class EdgeUpstreams(BaseModel):
    """The record an edge writes at P/edge-upstreams/<edge>: its Caddy's upstreams when read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    edge: str = Field(min_length=1, description="The edge host that read its Caddy (the record's key names it too).")
    at: datetime = Field(description="When the edge read its Caddy's upstreams (UTC).")
    upstreams: list[Upstream] = Field(default=[], description="Each upstream with its requests in flight and remembered failures.")


@dataclass(frozen=True)
class EdgeRecordProblem:
    """A stored record the leader skipped: whose key, and why."""

    key: str
    reason: str


def caddy_upstreams(payload: object) -> list[Upstream]:
    """The admin API's `GET /reverse_proxy/upstreams` answer (a JSON list, or
    null when Caddy proxies nothing) as upstreams."""
    if payload is None:
        return []
    if not isinstance(payload, list):
        raise ValueError(f"reverse_proxy/upstreams: expected a list, got {type(payload).__name__}")
    out = []
    for index, item in enumerate(payload):
        try:
            out.append(Upstream.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"reverse_proxy/upstreams[{index}]{'.' + where if where else ''}: {first['msg']}") from None
    return out


def edge_records(raw: Mapping[str, bytes], edges: Sequence[str]) -> tuple[list[EdgeUpstreams], list[EdgeRecordProblem]]:
    """Each stored record (key: the edge host it is stored under) parsed on
    its own; the ones that cannot count, named with the reason."""
    records: list[EdgeUpstreams] = []
    problems: list[EdgeRecordProblem] = []
    for key in sorted(raw):
        value = raw[key]
        reason = None
        if key not in edges:
            reason = "not written by an edge host"
        elif len(value) > MAX_RECORD_BYTES:
            reason = f"{len(value)} bytes, more than {MAX_RECORD_BYTES}"
        else:
            try:
                record = EdgeUpstreams.model_validate(json.loads(value))
            except (ValueError, ValidationError) as exc:
                reason = _why(exc)
            else:
                if record.edge != key:
                    reason = f"names edge {record.edge!r}, stored under {key!r}"
                else:
                    records.append(record)
        if reason is not None:
            problems.append(EdgeRecordProblem(key=key, reason=reason))
    return records, problems


def _why(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc']) or 'record'}: {first['msg']}"
    return f"not JSON: {exc}"


def edge_failing(records: Sequence[EdgeUpstreams], addresses: Mapping[str, str], now: datetime, max_age_s: float) -> dict[str, str]:
    """host -> what an edge says of it, for each host (by its declared
    address) whose every upstream in a fresh record fails."""
    now = utc(now)
    out: dict[str, str] = {}
    by_address = {address: host for host, address in addresses.items()}
    for record in sorted(records, key=lambda r: r.edge):
        if (now - utc(record.at)).total_seconds() > max_age_s:
            continue
        per_host: dict[str, list[Upstream]] = {}
        for upstream in record.upstreams:
            host = by_address.get(upstream.host)
            if host is not None:
                per_host.setdefault(host, []).append(upstream)
        for host, upstreams in sorted(per_host.items()):
            if host not in out and all(u.fails > 0 for u in upstreams):
                out[host] = f"{record.edge} sees all {len(upstreams)} upstream(s) failing"
    return out
