"""phaze's broker turned into a black hole under an open connection: the lane
queue's next read fails within its timeout instead of hanging.

Real PostgreSQL on the host end of a veth pair, the lane queue in a process
inside a network namespace at the other end. Once the queue has read the
lanes' states on its connection, an nft rule in that namespace drops every
packet to the broker, as a vanished network path does (no reset, no
answer). Without libpq's tcp_user_timeout the next read waits for the
kernel's retransmissions (some 15 minutes): the e2e leader's long-lived
connection hung on one, its step with it, and a lost node went offline 30 s
after its lapse."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, require, require_root
from tests.support.harness.netns import network_lab
from tests.support.harness.postgres import postgres_server
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.integration

TIMEOUT_S = 2.0

CLIENT = """
import sys, time
from reconciler.adapters.clock import SystemClock
from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.ports import LaneBrokerUnavailable

queue = PostgresLaneBroker(sys.argv[1], SystemClock(), connect_timeout_s=float(sys.argv[2]))
queue.lane_states({"lane-a": "fabric-lane-a"})
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
try:
    queue.lane_states({"lane-a": "fabric-lane-a"})
    print("answered", flush=True)
except LaneBrokerUnavailable as exc:
    print(f"unavailable after {time.monotonic() - started:.1f} s: {exc}", flush=True)
"""


def test_a_broker_that_vanishes_under_an_open_connection_fails_the_next_read_within_the_timeout() -> None:
    require_root()
    require("ip", "nft")
    octet = 200 + os.getpid() % 50
    host_address, client_address = f"10.250.{octet}.1", f"10.250.{octet}.2"
    with network_lab() as lab:
        client = lab.namespace("broker-client")
        host_end = f"fbq{os.getpid() % 100000}"
        subprocess.run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth1", "netns", client.name], check=True)
        try:
            subprocess.run(["ip", "addr", "add", f"{host_address}/30", "dev", host_end], check=True)
            subprocess.run(["ip", "link", "set", host_end, "up"], check=True)
            client.check("ip", "addr", "add", f"{client_address}/30", "dev", "eth1")
            client.check("ip", "link", "set", "eth1", "up")
            with postgres_server(listen_on=host_address, trusted_net=f"{host_address}/30") as pg:
                process = subprocess.Popen(
                    [*client.exec_prefix, sys.executable, "-c", CLIENT, pg.tcp_dsn_of("postgres"), str(TIMEOUT_S)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                    start_new_session=True,
                )
                try:
                    assert process.stdout is not None and process.stdin is not None
                    assert process.stdout.readline().strip() == "ready", process.stderr.read() if process.stderr else ""
                    client.check("nft", "add", "table", "inet", "blackhole")
                    client.check("nft", "add", "chain", "inet", "blackhole", "egress", "{ type filter hook output priority 0 ; }")
                    client.check("nft", "add", "rule", "inet", "blackhole", "egress", "ip", "daddr", host_address, "drop")
                    process.stdin.write("go\n")
                    process.stdin.flush()
                    out, err = process.communicate(timeout=deadline_for(TIMEOUT_S, at_least=30))
                    assert out.startswith("unavailable after "), (out, err)
                finally:
                    if process.poll() is None:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
        finally:
            subprocess.run(["ip", "link", "del", host_end], check=False, capture_output=True)
