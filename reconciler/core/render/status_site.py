"""The edge's Caddy site serving the fleet status page at `status.<domain>`.

The page itself is a view (`reconciler.core.views.page`); the pass writes it
under `STATUS_ROOT` every pass, outside the generation, and this site block,
part of the edge's Caddy snippet, serves that directory.
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache

from reconciler.core.desired.model import DesiredState
from reconciler.core.render.tailnet import TAILNET_RANGES
from reconciler.core.templating import environment as template_environment

STATUS_ROOT = "/var/lib/fabric/status"
STATUS_FILE = "index.html"
# The page's one inline script (it counts the page's age), included verbatim
# by templates/status.html.j2: the CSP allows it by its hash, and nothing else.
AGE_SCRIPT_TEMPLATE = "_status_age.js.j2"


@cache
def age_script_hash() -> str:
    """`'sha256-…'`: the CSP source of the page's script, as the page includes it."""
    text = template_environment("html").get_template(AGE_SCRIPT_TEMPLATE).render()
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def content_security_policy() -> str:
    """Nothing from anywhere; the page's inline style, and its one script by hash."""
    return f"default-src 'none'; style-src 'unsafe-inline'; script-src {age_script_hash()}"


def status_site_address(desired: DesiredState) -> str:
    """`status.<domain>`: the page's host name."""
    return f"{desired.fleet.fleet.status_subdomain}.{desired.fleet.fleet.domain}"


def _capabilities_block(desired: DesiredState, tailnet: tuple[str, ...]) -> list[str]:
    """The capabilities API (core.views.capabilities): /api/capabilities/nodes
    and /api/capabilities/nodes/<host> from the JSON files the edge's pass
    writes, to the tailnet (and fleet.capabilities_allow_from) only; 403 to
    anyone else, 404 for a host it has no document of."""
    allowed = " ".join([*tailnet, *desired.fleet.fleet.capabilities_allow_from])
    return [
        "\t@capabilities path /api/*",
        "\thandle @capabilities {",
        f"\t\t@outside not remote_ip {allowed}",
        '\t\trespond @outside "capabilities: tailnet only" 403',
        "\t\t@node path_regexp node ^/api/capabilities/nodes/([a-z0-9_-]+)$",
        "\t\trewrite @node /api/capabilities/nodes/{re.node.1}.json",
        "\t\trewrite /api/capabilities/nodes /api/capabilities/nodes.json",
        "\t\tfile_server",
        "\t}",
    ]


# What a source outside the tailnet gets from a tailnet-only status page.
TAILNET_ONLY_ANSWER = "403 Forbidden: the fleet's status page is served to the tailnet only ([fleet] status_access)."


def caddy_site(
    desired: DesiredState,
    root: str = STATUS_ROOT,
    *,
    address: str | None = None,
    bind: str | None = None,
    tailnet: tuple[str, ...] = TAILNET_RANGES,
) -> str:
    """A Caddyfile site block serving the page (for the edge host's Caddy config).

    `address` defaults to `status.<domain>` (Caddy then gets it a certificate);
    `bind` limits the listener to one address (the edge's public one, say).
    Read-only static files; `no-store` so a phone never shows a stale pass,
    and a strict CSP that the page (inline CSS, its one hashed script) satisfies.

    The page shows the fleet's hosts, load, lanes and deferred work: unless
    `[fleet] status_access` is "public", a request whose connection comes
    from outside `tailnet` (Tailscale's ranges; a test plays them with its
    own) gets 403 and nothing of the page. A matcher on the connection's
    address, not a `bind` to the tailnet address: the site keeps its public
    name, so Caddy's certificate challenges (answered before any route) still
    work. Caddy trusts no proxy header here (no trusted_proxies): the
    address is the TCP peer's.
    """
    lines = [f"{address or status_site_address(desired)} {{"]
    if bind:
        lines.append(f"\tbind {bind}")
    if desired.fleet.fleet.status_access == "tailnet":
        lines += [
            f"\t@outside_tailnet not remote_ip {' '.join(tailnet)}",
            f'\trespond @outside_tailnet "{TAILNET_ONLY_ANSWER}" 403',
        ]
    lines += [
        f"\troot * {root}",
        # Caddy orders `handle` before `respond`: the API's own handle
        # answers /api/* to its own sources, the page's matcher the rest.
        *_capabilities_block(desired, tailnet),
        "\tfile_server",
        "\theader {",
        '\t\tCache-Control "no-store"',
        f'\t\tContent-Security-Policy "{content_security_policy()}"',
        '\t\tX-Content-Type-Options "nosniff"',
        "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"
