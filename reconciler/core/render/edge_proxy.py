"""The values of the edge's `reverse_proxy` blocks that say how traffic moves
between a service's upstreams (templates/fabric.caddy.j2 explains each one).

They come from the desired state's `[edge]` section (`EdgeSettings`) and are
handed to the template as Caddy durations.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.desired.model import EdgeSettings


@dataclass(frozen=True)
class ProxyTimings:
    """Caddy duration strings, one per `reverse_proxy` subdirective they fill."""

    lb_try_duration: str
    lb_try_interval: str
    fail_duration: str
    dial_timeout: str


def caddy_duration(milliseconds: int) -> str:
    """`1500` -> `1500ms`, `2000` -> `2s`: whole seconds read as seconds in the Caddyfile."""
    return f"{milliseconds // 1000}s" if milliseconds % 1000 == 0 else f"{milliseconds}ms"


def proxy_timings(edge: EdgeSettings) -> ProxyTimings:
    return ProxyTimings(
        lb_try_duration=caddy_duration(edge.retry_window_ms),
        lb_try_interval=caddy_duration(edge.retry_interval_ms),
        fail_duration=caddy_duration(edge.fail_memory_ms),
        dial_timeout=caddy_duration(edge.dial_timeout_ms),
    )
