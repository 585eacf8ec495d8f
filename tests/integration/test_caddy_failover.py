"""The edge's reverse_proxy blocks moving real traffic when upstreams die and appear.

Each test renders templates/fabric.caddy.j2 with the `[edge]` settings
(`EdgeSettings`, through `proxy_timings`) for one site on loopback, runs a real
Caddy on it, and sends requests through it one after another, the way a
stream of clients would. The upstreams are processes of their own
(tests/support/harness/upstream_process.py), killed and started by PID.

Which upstream Caddy tried for each attempt comes from its own debug log
("selected upstream", with its timestamp): a dead upstream answers nothing, so
the log is the only witness of the attempts it got.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.adapters.commands import SubprocessRunner
from reconciler.core.desired.model import EdgeSettings
from reconciler.core.render.edge_proxy import proxy_timings
from reconciler.core.templating import environment
from tests.conftest import require, require_root
from tests.support.harness.caddy import RunningCaddy, free_port, running_caddy
from tests.support.harness.upstream_process import upstream_process
from tests.support.harness.waiting import SLOWDOWN, deadline_for, wait_until

pytestmark = pytest.mark.integration

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def edge_caddyfile(admin_address: str, site_port: int, upstreams: list[str], edge: EdgeSettings) -> str:
    """The rendered edge snippet for one site on 127.0.0.1:site_port, behind the
    global options a test Caddy needs (its admin address, no HTTPS, debug log)."""
    snippet = (
        environment("text")
        .get_template("fabric.caddy.j2")
        .render(
            host="test-edge",
            sites=[{"service": "svc", "host": f"http://127.0.0.1:{site_port}", "path": "/", "upstreams": upstreams}],
            proxy=proxy_timings(edge),
            status_site="",
        )
    )
    return f"{{\n\tadmin {admin_address}\n\tauto_https off\n\tdebug\n}}\n\n{snippet}\n"


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer at all
    body: str


def ask(url: str, timeout: float, *, body: bytes | None = None) -> Answer:
    try:
        with _DIRECT.open(urllib.request.Request(url, data=body), timeout=timeout) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode(errors="replace"))
    except OSError as exc:
        return Answer(None, str(exc))


def retry_cadence_s(edge: EdgeSettings) -> float:
    """How often Caddy tries a waiting request again at an upstream that
    failed it: after the fail memory has let it back in, at the next retry."""
    return (edge.fail_memory_ms + edge.retry_interval_ms) / 1000


def attempts_at(caddy: RunningCaddy, address: str, *, after: int = 0) -> list[float]:
    """Caddy's timestamps of every attempt it made at `address` (log bytes from `after` on)."""
    stamps = []
    for line in caddy.log()[after:].splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == "selected upstream" and entry.get("dial") == address:
            stamps.append(float(entry["ts"]))
    return stamps


@contextmanager
def edge_caddy(upstreams: list[str], edge: EdgeSettings) -> Iterator[RunningCaddy]:
    require_root()
    require("caddy")
    site_port = free_port()
    with running_caddy(lambda admin: edge_caddyfile(admin, site_port, upstreams, edge), site_port=site_port) as caddy:
        yield caddy


@contextmanager
def silent_host() -> Iterator[str]:
    """A loopback address whose connection attempts are never answered, as a
    host that vanished from the network: a listener with a backlog of 0 whose
    one queue place is taken, so the kernel drops every further SYN."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        filler.close()
        listener.close()


class Stream:
    """Requests to `url` one after another; every answer is kept."""

    def __init__(self, url: str, edge: EdgeSettings) -> None:
        self.url = url
        self.answers: list[Answer] = []
        # A request may take the whole retry window; more means Caddy is stuck.
        self.request_timeout = deadline_for(edge.retry_window_ms / 1000)

    def one(self) -> Answer:
        answer = ask(self.url, self.request_timeout)
        self.answers.append(answer)
        return answer

    def failures(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]


def assert_left_out_between_attempts(stamps: list[float], edge: EdgeSettings, address: str) -> None:
    """Once an attempt at `address` failed, Caddy sent it nothing for fail_memory_ms."""
    window = edge.fail_memory_ms / 1000
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    assert gaps and all(gap >= window for gap in gaps), f"attempts at {address} {window} s apart at least; gaps were {gaps}"


def test_a_killed_upstream_fails_no_request_and_is_left_out_for_the_fail_window() -> None:
    """Two upstreams, one killed mid-stream: every request is answered (by the
    other), and the dead one is tried at most once per fail_memory_ms."""
    edge = EdgeSettings()  # what the fleet renders by default
    with upstream_process("one", free_port()) as one, upstream_process("two", free_port()) as two:
        with edge_caddy([one.address, two.address], edge) as caddy:
            stream = Stream(caddy.site_url, edge)
            served: set[str] = set()
            wait_until(lambda: served.add(stream.one().body) or served == {"one", "two"}, what="both upstreams serving")

            before_kill = len(caddy.log())
            stream = Stream(caddy.site_url, edge)
            one.kill()
            # Keep asking until Caddy went back to the dead upstream twice after
            # its first failure there: three fail windows of a live stream.
            wait_until(
                lambda: stream.one() and len(attempts_at(caddy, one.address, after=before_kill)) >= 3,
                timeout=deadline_for(3 * edge.fail_memory_ms / 1000 + edge.retry_window_ms / 1000),
                interval=0.01,
                what="three attempts at the killed upstream",
            )

            assert stream.failures() == []
            assert {a.body for a in stream.answers} == {"two"}
            assert_left_out_between_attempts(attempts_at(caddy, one.address, after=before_kill), edge, one.address)


def test_an_upstream_down_at_the_reload_gets_a_waiting_request_as_soon_as_it_answers() -> None:
    """The edge routes to a replacement whose service is not up yet (the move
    issue 14 measured): a request that arrives meanwhile waits in the retry
    window and is served by the replacement once it answers; no active health
    check runs (it would keep the replacement out until its next probe)."""
    # A retry window longer than the default so that a slow process start on a
    # loaded machine stays inside it; what is under test is that nothing but
    # a failed request (fail_memory_ms) keeps the replacement out.
    edge = EdgeSettings(retry_window_ms=15_000)
    with upstream_process("replacement", free_port(), started=False) as replacement:
        with edge_caddy([replacement.address], edge) as caddy:
            admin = CaddyAdmin(SubprocessRunner(caddy.env), admin_address=caddy.admin_address)
            handlers = [
                handler
                for server in admin.current_config()["apps"]["http"]["servers"].values()
                for route in server["routes"]
                for handler in _handlers(route)
                if handler.get("handler") == "reverse_proxy"
            ]
            assert handlers and all("active" not in (h.get("health_checks") or {}) for h in handlers), handlers

            waiting: list[Answer] = []
            request = threading.Thread(target=lambda: waiting.append(ask(caddy.site_url, deadline_for(edge.retry_window_ms / 1000))))
            request.start()
            try:
                # The request reached Caddy, and its attempts (the first and
                # two retries) found nobody.
                wait_until(
                    lambda: len(attempts_at(caddy, replacement.address)) >= 3,
                    timeout=deadline_for(3 * retry_cadence_s(edge)),
                    what="the request's attempts at the replacement (an active health check that found it down keeps every request away)",
                )
                replacement.start()
            finally:
                request.join()

            assert waiting == [Answer(200, "replacement")]
            # "As soon as it answers": Caddy tried the waiting request again
            # at its retry cadence while the replacement was down, and so
            # once more soon after it came up (the attempt that it answered).
            # Caddy's own timestamps; a loaded machine's SLOWDOWN allowed.
            stamps = attempts_at(caddy, replacement.address)
            gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
            assert len(gaps) >= 3 and max(gaps) <= SLOWDOWN * retry_cadence_s(edge), (
                f"attempts at the replacement {gaps} s apart (retry cadence {retry_cadence_s(edge):g} s)"
            )
            assert ask(caddy.site_url, deadline_for(edge.retry_window_ms / 1000)) == Answer(200, "replacement")


def test_a_vanished_host_costs_a_request_one_dial_timeout_then_another_upstream_answers() -> None:
    """An upstream whose host answers no connection attempt (powered off, off
    the tailnet): with a retry window shorter than Caddy's own 3 s dial timeout,
    only the rendered dial_timeout lets a request try the other upstream in time."""
    edge = EdgeSettings(retry_window_ms=2500)
    with silent_host() as gone, upstream_process("two", free_port()) as two:
        with edge_caddy([gone, two.address], edge) as caddy:
            stream = Stream(caddy.site_url, edge)
            wait_until(
                lambda: stream.one() and len(attempts_at(caddy, gone)) >= 2,
                timeout=deadline_for(2 * (edge.fail_memory_ms + edge.dial_timeout_ms) / 1000 + edge.retry_window_ms / 1000),
                interval=0.01,
                what="two attempts at the vanished host",
            )

            assert stream.failures() == []
            assert {a.body for a in stream.answers} == {"two"}
            assert_left_out_between_attempts(attempts_at(caddy, gone), edge, gone)


def test_an_upstream_answering_503_is_left_out_for_the_fail_window() -> None:
    """An upstream that answers "cannot serve now" counts as failed: it gets one
    request per fail_memory_ms, and its answer goes to the client as it is."""
    edge = EdgeSettings()
    with upstream_process("sick", free_port(), status=503) as sick, upstream_process("two", free_port()) as two:
        with edge_caddy([sick.address, two.address], edge) as caddy:
            stream = Stream(caddy.site_url, edge)
            wait_until(
                lambda: stream.one() and len(attempts_at(caddy, sick.address)) >= 3,
                timeout=deadline_for(3 * edge.fail_memory_ms / 1000),
                interval=0.01,
                what="three attempts at the upstream answering 503",
            )

            assert stream.failures() == [Answer(503, "sick")] * 3
            assert {a.body for a in stream.answers if a.status == 200} == {"two"}
            assert_left_out_between_attempts(attempts_at(caddy, sick.address), edge, sick.address)


def test_a_request_with_a_body_is_resent_only_by_caddy_2_11_and_later() -> None:
    """What the template says of bodies, on the Caddy installed here: a POST
    whose first attempt meets a dead upstream fails before Caddy 2.11 (the
    failed attempt closed its body) and is served by the other upstream after."""
    edge = EdgeSettings()
    version = subprocess.run(["caddy", "version"], capture_output=True, text=True, check=True).stdout.split()[0]
    resends_bodies = tuple(int(part) for part in version.lstrip("v").split(".")[:2]) >= (2, 11)
    dead = f"127.0.0.1:{free_port()}"  # nobody listens there: connections are refused
    with upstream_process("two", free_port()) as two:
        with edge_caddy([dead, two.address], edge) as caddy:
            answers: list[Answer] = []

            def post_meets_the_dead_upstream() -> bool:
                before = len(attempts_at(caddy, dead))
                answers.append(ask(caddy.site_url, deadline_for(edge.retry_window_ms / 1000), body=b"a body"))
                return len(attempts_at(caddy, dead)) > before

            wait_until(post_meets_the_dead_upstream, timeout=deadline_for(2 * edge.fail_memory_ms / 1000), what="a POST meeting the dead upstream")

            assert answers[:-1] == [Answer(200, "two")] * (len(answers) - 1)
            assert answers[-1].status == (200 if resends_bodies else 502), (version, answers[-1])


def _handlers(route: dict) -> Iterator[dict]:
    """Every handler of a route, subroutes included."""
    for handler in route.get("handle", []):
        yield handler
        for inner in handler.get("routes", []):
            yield from _handlers(inner)
