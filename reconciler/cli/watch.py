"""fabric watch: start a pass as soon as the registry says something changed for this host (fabric-watch.service).

`fabric watch [--host NAME] [--desired DIR] [--registry-path FILE]` runs until
SIGTERM/SIGINT (`reconciler.engine.watch`): it follows this host's part of
the newest plan (the services placed here; on the edge, each routed service's
nodes) and this host's drain request and node state (etcd: a watch on those
keys; sqlite: a read every --poll-interval) and starts fabric-reconcile.service
over D-Bus (StartUnit, mode "replace") when one changed: at once for a new
part of the plan, --window after a drain request or node state (the plan the
leader publishes in answer usually follows), never while a pass runs (it
waits for that pass to end, and starts none when that pass took the plan:
its record in --state-dir names the plan's epoch). Before it starts one it
records its ask there: with a git [source], `fabric pull` (the pass's
ExecStartPre) then does not fetch first while its last fetch is recent. An
unreachable registry or systemd is retried, doubling the wait up to
--retry-max; fabric-reconcile.timer goes on passing meanwhile.

Beside it, on a connection of its own, it keeps this host's fast liveness
record alive every [timing] liveness_s (etcd: P/liveness/<host> on a short
lease; sqlite: a row's deadline), which lapses [timing] liveness_ttl_s after
the last keep-alive: the leader then suspects the host and hedges its
single-replica services (issue 30). --no-liveness (or liveness_s = 0) keeps none.

Exit 2: bad options or desired state; exit 1: the registry refused this
identity (a retry would not help).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
import threading
from pathlib import Path

from reconciler.cli import EXIT_OK, InvalidInput
from reconciler.cli.registry_options import add_registry_options, desired_and_registry, opened_registry
from reconciler.core.desired.model import TimingSettings
from reconciler.core.install.units import RECONCILE_SERVICE
from reconciler.core.live.records import check_node_id
from reconciler.core.live.watching import PASS_ASKED, PLAN_TAKEN, WatchTimings, epoch_taken, moment_record
from reconciler.engine.desired_load import load_for_part, load_own
from reconciler.engine.pass_options import STATE_DIR
from reconciler.engine.watch import LivenessKeeper, Watcher
from reconciler.ports import LivenessConnection
from reconciler.wiring import caddy_upstreams_reader, host_name, local_tree, pass_starter, system_clock

DEFAULTS = WatchTimings()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 3600] seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="start a reconcile pass as soon as the registry changes for this host (fabric-watch.service)")
    add_registry_options(p)
    p.add_argument("--host", metavar="NAME", help="this host's name (default: this machine's)")
    p.add_argument("--unit", default=RECONCILE_SERVICE, help=f"the unit to start (default: {RECONCILE_SERVICE})")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        type=Path,
        default=Path("/") / STATE_DIR,
        help=f"the pass's state directory: the pass records there the plan it took, the watcher its ask for a pass (default: /{STATE_DIR})",
    )
    p.add_argument(
        "--systemd-bus",
        metavar="ADDRESS",
        default=os.environ.get("FABRIC_SYSTEMD_BUS"),
        help="D-Bus address of the systemd to start it through (default: $FABRIC_SYSTEMD_BUS or the system bus)",
    )
    p.add_argument(
        "--window",
        type=_seconds,
        default=DEFAULTS.window_s,
        metavar="S",
        help=f"how long a drain request or node state change waits for the plan that follows it (default {DEFAULTS.window_s:g})",
    )
    p.add_argument(
        "--poll-interval",
        type=_seconds,
        default=DEFAULTS.poll_s,
        metavar="S",
        help=f"how often a sqlite registry is read (default {DEFAULTS.poll_s:g}; a running pass that changes wait for is looked at every {DEFAULTS.running_poll_s:g})",
    )
    p.add_argument(
        "--retry-max",
        type=_seconds,
        default=DEFAULTS.retry_max_s,
        metavar="S",
        help=f"longest wait between tries of an unreachable registry or systemd (default {DEFAULTS.retry_max_s:g})",
    )
    p.add_argument(
        "--caddy-admin",
        metavar="HOST:PORT",
        default="localhost:2019",
        help="on an edge host: Caddy's admin API, whose failed upstreams are reported beside the liveness record (default localhost:2019)",
    )
    p.add_argument(
        "--no-liveness",
        action="store_true",
        help="keep no fast liveness record (default: kept alive every [timing] liveness_s; its lapse makes the leader suspect this host)",
    )
    p.set_defaults(func=run)


def _log(message: str) -> None:
    print(f"fabric-watch: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    host = args.host or host_name()
    try:
        check_node_id(host)
    except ValueError as exc:
        raise InvalidInput(f"fabric watch: --host: {exc}") from None
    timings = WatchTimings(
        window_s=args.window, poll_s=args.poll_interval, retry_min_s=min(DEFAULTS.retry_min_s, args.retry_max), retry_max_s=args.retry_max
    )
    with (
        desired_and_registry(args) as (desired, registry),
        opened_registry(args, desired) as liveness_registry,
        pass_starter(args.unit, args.systemd_bus) as starter,
    ):
        # Read again at each new plan: a route or host added since the watcher started counts.
        desired_for = functools.partial(load_for_part, args.desired, host)
        records = local_tree(args.state_dir)
        clock = system_clock()
        watcher = Watcher(
            registry,
            starter,
            clock,
            host,
            desired_for,
            own_desired=functools.partial(load_own, args.desired, host),
            timings=timings,
            epoch_taken=lambda: epoch_taken(records.read(PLAN_TAKEN)),
            record_ask=lambda: records.write(PASS_ASKED, moment_record(clock.now())),
            log=_log,
        )
        keeper = _liveness_keeper(args, desired.fleet.timing, host, liveness_registry)
        if keeper is not None and host in desired.hosts_with_role("edge"):
            # Issue 30: the edge's Caddy as a source of suspicion (its failed upstreams).
            keeper = dataclasses.replace(
                keeper, edge_upstreams=caddy_upstreams_reader(args.caddy_admin), clock=clock, edge_refresh_s=desired.fleet.timing.heartbeat_s / 3
            )
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: (watcher.stop(), keeper and keeper.stop()))
        _log(f"watching {host}'s part of the plan and its entries; starting {args.unit} on a change")
        thread = None
        if keeper is not None:
            _log(f"keeping {host}'s liveness record alive every {keeper.interval_s:g} s (it lapses {keeper.ttl_s:g} s after the last)")
            thread = threading.Thread(target=keeper.run, name="fabric-liveness", daemon=True)
            thread.start()
        try:
            watcher.run()
        finally:
            if keeper is not None and thread is not None:
                keeper.stop()
                thread.join(timeout=keeper.interval_s + 5)
    return EXIT_OK


def _liveness_keeper(args: argparse.Namespace, timing: TimingSettings, host: str, registry: LivenessConnection) -> LivenessKeeper | None:
    """The fast liveness keeper, or None when [timing] liveness_s = 0 or --no-liveness."""
    interval = 0 if args.no_liveness else timing.liveness_s
    if not interval:
        return None
    return LivenessKeeper(registry, host, float(interval), float(timing.liveness_ttl_s), log=_log)
