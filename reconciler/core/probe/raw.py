"""Raw probe outputs and their parsing into values (pure).

`RawCapture` is the text every source gave (keyed by the fixed raw file names)
plus, for each source that gave nothing usable, the reason. The live collector
and a replayed capture directory both produce one; `parse_capture` turns it
into `ParsedFacts` the same way for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
