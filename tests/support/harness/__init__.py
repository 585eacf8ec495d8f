"""Reusable fixtures that start the real components tests run against.

Each helper starts its program itself and stops it by PID in a `finally`, so a
failing test leaves no process, container, namespace or mount behind:

- `systemd.systemd_container()`: systemd as PID 1 with its own system D-Bus.
- `netns.network_namespaces()`: network namespaces joined by veth pairs.
- `caddy.caddy_server()`: a Caddy with its admin API on a free loopback port.
"""
