"""Raw probe outputs and their parsing into values (pure).

`RawCapture` is the text every source gave (keyed by the fixed raw file names)
plus, for each source that gave nothing usable, the reason. The live collector
and a replayed capture directory both produce one; `parse_capture` turns it
into `ParsedFacts` the same way for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from reconciler.core.probe.facts import FACTS, Fact
from reconciler.core.probe.parsers import ParseError


@dataclass(frozen=True)
class RawCapture:
    # raw name -> text as printed or read (kept even for a failed command:
    # its message is what an operator needs to see).
    outputs: dict[str, str] = field(default_factory=dict)
    # raw name -> why the source gave nothing usable (not installed, timed
    # out, exit status, file not there). Takes precedence over the output.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedFacts:
    values: dict[str, Any]  # fact name -> parsed value
    missing: dict[str, str]  # fact name -> reason it is absent

    def get(self, name: str) -> Any:
        return self.values.get(name)


def absent_reason(fact: Fact) -> str:
    return f"no '{fact.raw}' in the capture (absent on that machine)"


def parse_capture(capture: RawCapture, facts: tuple[Fact, ...] = FACTS) -> ParsedFacts:
    values: dict[str, Any] = {}
    missing: dict[str, str] = {}
    for fact in facts:
        if fact.raw in capture.errors:
            missing[fact.name] = capture.errors[fact.raw]
            continue
        text = capture.outputs.get(fact.raw)
        if text is None:
            missing[fact.name] = absent_reason(fact)
            continue
        try:
            values[fact.name] = fact.parser(text)
        except ParseError as exc:
            missing[fact.name] = f"{fact.raw}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a probe must never take the pass down
            # Parsers raise only ParseError (a property test holds them to
            # it); this is the last guard, and it says it is a bug.
            missing[fact.name] = f"{fact.raw}: parser bug ({type(exc).__name__}: {str(exc)[:120]})"
    return ParsedFacts(values, missing)


def facts_key(parsed: ParsedFacts) -> str:
    """The parsed facts as one canonical text: equal for two probes of an
    unchanged machine, different when anything HostFacts is built from
    differs (tiering.build_node_facts reads nothing but `parsed` and the host).

    The parsers already keep only what does not change by itself (the total
    of /proc/meminfo, not what is free; the CPU count, not their MHz; the
    tailnet name, not its traffic), so the raw outputs' per-second counters
    never reach this text, while a GPU, a memory size, a CPU count or a
    tailnet name that changes does. The pass memo keys a live probe on it
    without importing the models that HostFacts needs."""
    return json.dumps({"values": _plain(parsed.values), "missing": parsed.missing}, sort_keys=True)


def _plain(value: Any) -> Any:
    """A parsed value as JSON: dataclasses by field name, tuples as lists."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)  # no parser returns another type today; a probe must never take the pass down
