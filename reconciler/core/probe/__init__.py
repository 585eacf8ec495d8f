"""The hardware probe: what this machine is and can do, as `NodeFacts`.

    raw text  --(facts.FACTS: source + parser)-->  parsed values  --(tiering)-->  NodeFacts

- `collect.collect_live(runner, files)` reads every source through the ports.
- A capture directory (`fabric probe --capture DIR`) holds the same raw text
  under fixed names; `reconciler.adapters.probe_io.CaptureDirectory` saves and
  loads it, so `--replay DIR` re-parses exactly what the machine printed.
- `facts_from_capture(capture)` parses and tiers (pure).
- `damping.damp` keeps a node's tier through a one-pass device blip.
"""

from __future__ import annotations

from reconciler.core.desired.model import NodeFacts
from reconciler.core.probe.raw import ParsedFacts, RawCapture, parse_capture
from reconciler.core.probe.tiering import build_node_facts

__all__ = ["ParsedFacts", "RawCapture", "facts_from_capture", "parse_capture"]


def facts_from_capture(capture: RawCapture, host: str | None = None) -> NodeFacts:
    """Parse every raw output and derive the node's facts. `host` replaces
    the machine's own host name (the fabric host this probe speaks for)."""
    return build_node_facts(parse_capture(capture), host=host)
