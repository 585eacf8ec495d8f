"""The edge's Caddy site serving the fleet status page at `status.<domain>`.

The page itself is a view (`reconciler.core.views.page`); the pass writes it
under `STATUS_ROOT` every pass, outside the generation, and this site block,
part of the edge's Caddy snippet, serves that directory.
"""

from __future__ import annotations

from reconciler.core.desired.model import DesiredState

STATUS_ROOT = "/var/lib/fabric/status"
STATUS_FILE = "index.html"


def status_site_address(desired: DesiredState) -> str:
    """`status.<domain>`: the page's host name."""
    return f"{desired.fleet.fleet.status_subdomain}.{desired.fleet.fleet.domain}"


def caddy_site(desired: DesiredState, root: str = STATUS_ROOT, *, address: str | None = None, bind: str | None = None) -> str:
    """A Caddyfile site block serving the page (for the edge host's Caddy config).

    `address` defaults to `status.<domain>` (Caddy then gets it a certificate);
    `bind` limits the listener to one address (the edge's public one, say).
    Read-only static files; `no-store` so a phone never shows a stale pass,
    and a strict CSP that the page (no script, inline CSS only) satisfies.
    """
    lines = [f"{address or status_site_address(desired)} {{"]
    if bind:
        lines.append(f"\tbind {bind}")
    lines += [
        f"\troot * {root}",
        "\tfile_server",
        "\theader {",
        '\t\tCache-Control "no-store"',
        "\t\tContent-Security-Policy \"default-src 'none'; style-src 'unsafe-inline'\"",
        '\t\tX-Content-Type-Options "nosniff"',
        "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"
