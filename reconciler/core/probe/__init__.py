"""The hardware probe: what this machine is and can do, as `HostFacts`.

    raw text  --(facts.FACTS: source + parser)-->  parsed values  --(tiering)-->  HostFacts

- `collect.collect_live(runner, files)` reads every source through the ports.
- A capture directory (`fabric probe --capture DIR`) holds the same raw text
  under fixed names; `reconciler.adapters.probe_io.CaptureDirectory` saves and
  loads it, so `--replay DIR` re-parses exactly what the machine printed.
- `facts_from_capture(capture)` parses and tiers (pure).
- `raw.facts_key(parsed)` is what HostFacts are derived from, without the
  models: the pass memo keys a live probe on it (this package and raw,
  facts and parsers import no model; tiering does, when facts are built).
- `damping.damp` keeps a node's tier through a one-pass device blip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reconciler.core.probe.raw import ParsedFacts, RawCapture, facts_key, parse_capture

if TYPE_CHECKING:
    from reconciler.core.desired.model import HostFacts

__all__ = ["ParsedFacts", "RawCapture", "facts_from_capture", "facts_key", "parse_capture"]


def facts_from_capture(capture: RawCapture, host: str | None = None) -> HostFacts:
    """Parse every raw output and derive the node's facts. `host` replaces
    the machine's own host name (the fabric host this probe speaks for)."""
    from reconciler.core.probe.tiering import build_node_facts

    return build_node_facts(parse_capture(capture), host=host)
