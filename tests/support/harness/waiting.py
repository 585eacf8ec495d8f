"""Waiting for an outside program to reach a state (never a fixed sleep)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# How many times slower than configured a loaded 2-core machine may be (CI runs
# beside a CPU-heavy process and other suites) before a wait counts as broken.
SLOWDOWN = 5.0


def deadline_for(configured_s: float, *, at_least: float = 10.0) -> float:
    """A timeout for something the configuration says happens within
    `configured_s` (a TTL, a pass interval, a node timeout): that timing scaled
    generously, never under `at_least` (a process must start, a store answer)."""
    return max(at_least, SLOWDOWN * configured_s)


def wait_until(probe: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> T:
    """Call `probe` until it returns something truthy and return that; fail after `timeout`.

    The timeout only bounds a broken run: tests assert on what `probe` saw,
    never on how long it took.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last value {value!r})")
        time.sleep(interval)


def stop_process(process: subprocess.Popen, *, timeout: float = 10.0) -> None:
    """SIGTERM a process this test started (by its PID), SIGKILL it if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
