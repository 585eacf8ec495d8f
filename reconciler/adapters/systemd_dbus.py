"""The `Systemd` port over systemd's D-Bus API (org.freedesktop.systemd1.Manager).

`run_jobs` queues one job per unit with mode "replace", all of them before
waiting for any (systemd runs them at once and orders them by the units' own
After=/Requires=), then waits for every job's `JobRemoved` signal and result
and for every unit to settle (leave `activating`, `deactivating`, `reloading`),
so the caller knows what actually happened rather than what was asked for. A
job that ends in anything but "done", or a started unit that settles in
`failed`, is that unit's failure, naming the job result and the unit's own
state and result (e.g. `exit-code`, status 1); the other units' jobs are not
affected.

A start or restart that systemd refuses with NoSuchUnit (it has no file for
the unit) gets one daemon-reload and is queued again, before any job of the
batch is waited for. A pass starts a new unit without a daemon-reload (the
file is read at the start, see `units_held`), and systemd notices a new file
by the unit directories' mtimes, which the kernel takes from its coarse clock:
a file renamed into place in the same tick as systemd last scanned the
directories is not seen until a reload.

The methods are synchronous: the object owns a private asyncio event loop and
one bus connection, opened on first use and closed by `close()` (or `with`).
Do not call it from inside a running event loop.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from reconciler.ports import ActivationError, JobOutcome, UnitJob

SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_INTERFACE = "org.freedesktop.systemd1.Manager"
UNIT_INTERFACE = "org.freedesktop.systemd1.Unit"
SERVICE_INTERFACE = "org.freedesktop.systemd1.Service"
PROPERTIES_INTERFACE = "org.freedesktop.DBus.Properties"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"

# ActiveState values a unit only passes through; anything else is settled.
TRANSITIONAL_STATES = frozenset({"activating", "deactivating", "reloading", "refreshing"})

_JOB_METHODS: dict[str, str] = {"stop": "StopUnit", "reload": "ReloadUnit", "restart": "RestartUnit", "start": "StartUnit"}

# The first systemd that loads a unit held as a not-found stub from disk at
# its next start, once the unit directories changed since it last looked
# (manager_unit_cache_should_retry_load); an older one keeps the stub until a
# daemon-reload.
RETRIES_NOT_FOUND_SINCE = 246


def systemd_major_version(version: str) -> int | None:
    """The major version in the Manager's Version property ("252.39-1~deb12u2",
    "256.8", "257", "v255-stable"); None if it does not start with one."""
    match = re.match(r"v?(\d+)", version.strip())
    return int(match.group(1)) if match else None


_JOB_REMOVED_MATCH = f"type='signal',sender='{SYSTEMD_BUS_NAME}',path='{MANAGER_PATH}',interface='{MANAGER_INTERFACE}',member='JobRemoved'"


class SystemdDbus:
    """`reconciler.ports.Systemd` for the system manager at `bus_address`.

    `bus_address` is a D-Bus address such as `unix:path=/run/dbus/system_bus_socket`;
    None means the system bus. `job_timeout` bounds the wait for the jobs of one
    batch (systemd's own start/stop timeouts normally end a job first);
    `settle_timeout` bounds the wait for a unit to leave a transitional state
    once its job is done.

    `startup_grace` (seconds, default 0) is how long the started or restarted
    services of one batch are watched, together, once all their jobs are done: a
    `Type=simple` service counts as started as soon as it is forked, so a program
    that exits at once would otherwise go unnoticed. A unit that fails or is
    being restarted by `Restart=` within the grace period fails its outcome.
    """

    def __init__(
        self,
        bus_address: str | None = None,
        *,
        job_timeout: float = 300.0,
        settle_timeout: float = 30.0,
        settle_poll_interval: float = 0.02,
        startup_grace: float = 0.0,
        follow_jobs: bool = True,
    ) -> None:
        self._bus_address = bus_address
        # Without it no JobRemoved signal is subscribed to or kept: for a
        # long-running client that only queues jobs (`enqueue_start`) and reads
        # states, which would otherwise keep every job of the host it is sent.
        self._follow_jobs = follow_jobs
        self._job_timeout = job_timeout
        self._settle_timeout = settle_timeout
        self._settle_poll_interval = settle_poll_interval
        self._startup_grace = startup_grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bus: MessageBus | None = None
        # JobRemoved results by job object path. A fast job can finish before the
        # StartUnit reply reaches us, so every result is kept until it is claimed.
        self._finished_jobs: dict[str, str] = {}
        self._job_waiters: dict[str, asyncio.Future[str]] = {}
        self._disconnected: asyncio.Future[None] | None = None  # done once the bus connection is gone
        self._connecting: asyncio.Lock | None = None  # made with the event loop
        self._retries_not_found: bool | None = None  # read from the manager's Version once per connection

    # -- the Systemd port -------------------------------------------------

    def daemon_reload(self) -> None:
        # Manager.Reload replies only once the reload is complete.
        self._run(self._call_manager("Reload", "", [], what="daemon-reload"))

    def run_jobs(self, job: UnitJob, units: Sequence[str]) -> list[JobOutcome]:
        if not units:
            return []
        return self._run(self._unit_jobs(job, list(dict.fromkeys(units))))

    def active_state(self, unit: str) -> str:
        return self._run(self._unit_properties(unit))["ActiveState"]

    def units_held(self, units: Sequence[str]) -> dict[str, bool]:
        return self._run(self._units_held(list(dict.fromkeys(units))))

    # -- additions beyond the port (used by tests and diagnostics) ----------

    def unit_properties(self, unit: str) -> dict[str, Any]:
        """ActiveState, SubState, LoadState, Result, MainPID, ExecMainStatus,
        NRestarts, InvocationID (hex) and JobQueued of a unit.

        An unknown unit reads as inactive with LoadState "not-found"."""
        return self._run(self._unit_properties(unit))

    def enqueue_start(self, unit: str) -> str:
        """StartUnit with mode "replace", returning the job's object path as
        soon as systemd queued it (the job is not waited for). Of a oneshot
        service whose start job is running, systemd merges the new job into it:
        no second run follows."""

        async def call() -> str:
            bus = await self._connected()
            try:
                reply = await self._call(bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, "StartUnit", "ss", [unit, "replace"], what="start")
            except _DbusCallError as exc:
                raise ActivationError(f"start {unit}: {exc.text or exc.name}") from exc
            return str(reply.body[0])

        return self._run(call())

    def close(self) -> None:
        if self._loop is None:
            return
        if self._bus is not None:
            if self._bus.connected:
                self._bus.disconnect()
            if self._disconnected is not None:
                try:
                    self._loop.run_until_complete(self._disconnected)
                except Exception:  # noqa: BLE001 - closing: how the connection ended no longer matters
                    pass
                self._disconnected = None
            self._bus = None
        self._loop.close()
        self._loop = None

    def __enter__(self) -> SystemdDbus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._connecting = asyncio.Lock()
        return self._loop.run_until_complete(coro)

    async def _connected(self) -> MessageBus:
        if self._bus is not None and self._bus.connected:
            return self._bus
        assert self._connecting is not None
        # The units of a batch are read concurrently: one of them reconnects.
        async with self._connecting:
            if self._bus is not None and self._bus.connected:
                return self._bus
            return await self._connect()

    async def _connect(self) -> MessageBus:
        try:
            if self._bus_address is None:
                bus = MessageBus(bus_type=BusType.SYSTEM)
            else:
                bus = MessageBus(bus_address=self._bus_address)
            await bus.connect()
        except Exception as exc:  # connection refused, no socket, auth failure
            where = self._bus_address or "the system bus"
            raise ActivationError(f"cannot connect to systemd on {where}: {exc}") from exc
        self._bus = bus
        self._disconnected = asyncio.ensure_future(bus.wait_for_disconnect())
        self._retries_not_found = None  # systemd may have been re-executed as another version
        if not self._follow_jobs:
            return bus
        bus.add_message_handler(self._on_message)
        self._finished_jobs.clear()
        self._job_waiters.clear()
        # systemd only emits JobRemoved once some client has subscribed, and the bus
        # only delivers signals that match a rule of ours.
        await self._call(
            bus, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch", "s", [_JOB_REMOVED_MATCH], what="subscribe"
        )
        await self._call_manager("Subscribe", "", [], what="subscribe")
        return bus

    def _on_message(self, message: Message) -> None:
        if message.message_type is MessageType.SIGNAL and message.member == "JobRemoved" and message.interface == MANAGER_INTERFACE:
            _job_id, job_path, _unit, result = message.body
            waiter = self._job_waiters.pop(job_path, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(result)
            else:
                self._finished_jobs[job_path] = result

    async def _call(
        self, bus: MessageBus, destination: str, path: str, interface: str, member: str, signature: str, body: list[Any], *, what: str
    ) -> Message:
        reply = await bus.call(Message(destination=destination, path=path, interface=interface, member=member, signature=signature, body=body))
        if reply.message_type is MessageType.ERROR:
            raise _DbusCallError(reply.error_name or "unknown", str(reply.body[0]) if reply.body else "", what)
        return reply

    async def _call_manager(self, member: str, signature: str, body: list[Any], *, what: str) -> Message:
        bus = await self._connected()
        try:
            return await self._call(bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, member, signature, body, what=what)
        except _DbusCallError as exc:
            raise ActivationError(f"{what}: {exc.text or exc.name}") from exc

    async def _unit_jobs(self, verb: UnitJob, units: list[str]) -> list[JobOutcome]:
        if not self._follow_jobs:
            raise ActivationError(f"{verb} {', '.join(units)}: this systemd client does not follow jobs (follow_jobs=False)")
        bus = await self._connected()
        # Results of jobs no batch waits for (dependencies, other clients);
        # none of this batch's jobs is queued yet.
        self._finished_jobs.clear()
        # Every job is queued before any is waited for: systemd runs them
        # together, so one unit's start can wait for another's (After=, or a
        # file another creates) without a deadlock.
        jobs, failures, not_found = await self._queue_jobs(bus, verb, units)
        retried: set[str] = set()
        if not_found and verb in ("start", "restart"):
            # systemd has no file for them: its scan of the unit directories
            # may have missed one just written (see the module docstring).
            # Reload once and queue them again, while the batch's other jobs
            # run (systemd keeps queued jobs across a reload).
            try:
                await self._call_manager("Reload", "", [], what="daemon-reload")
            except ActivationError as exc:
                failures.update({unit: f"{failures[unit]} (and the daemon-reload to look again failed: {exc})" for unit in not_found})
            else:
                retried = set(not_found)
                for unit in not_found:
                    del failures[unit]
                again, failed_again, _ = await self._queue_jobs(bus, verb, not_found)
                jobs.update(again)
                failures.update(failed_again)
        try:
            results, unfinished = await self._job_results(jobs)
        finally:
            self._finished_jobs.clear()
        failures.update(unfinished)
        settled = await asyncio.gather(*(self._settled_outcome(unit, verb, result) for unit, result in results.items()))
        started: dict[str, dict[str, Any]] = {}
        for unit, outcome in zip(results, settled, strict=True):
            if isinstance(outcome, str):
                failures[unit] = outcome
            elif verb in ("start", "restart") and unit.endswith(".service"):
                started[unit] = outcome
        if self._startup_grace > 0 and started:
            failures.update(await self._watch_startup(started))
        return [JobOutcome(unit, failures.get(unit), retried_after_reload=unit in retried) for unit in units]

    async def _queue_jobs(self, bus: MessageBus, verb: UnitJob, units: list[str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
        """Queue `verb` for each unit: the job object paths by unit, the
        units systemd refused with why, and which of those it has no file for."""
        jobs: dict[str, str] = {}
        failures: dict[str, str] = {}
        not_found: list[str] = []
        for unit in units:
            try:
                reply = await self._call(
                    bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, _JOB_METHODS[verb], "ss", [unit, "replace"], what=verb
                )
            except _DbusCallError as exc:
                if exc.name == NO_SUCH_UNIT:
                    if verb == "stop":  # an unknown unit is already stopped
                        continue
                    not_found.append(unit)
                failures[unit] = exc.text or exc.name
                continue
            jobs[unit] = reply.body[0]
        return jobs, failures, not_found

    async def _units_held(self, units: list[str]) -> dict[str, bool]:
        retries_not_found = await self._manager_retries_not_found()
        states = await asyncio.gather(*(self._load_state(unit) for unit in units))
        return {unit: not (state == "not-found" and retries_not_found) for unit, state in zip(units, states, strict=True)}

    async def _manager_retries_not_found(self) -> bool:
        """Whether this systemd loads a not-found stub from disk at its next
        start (>= 246); False when its version cannot be told (conservative:
        the stub counts as held)."""
        bus = await self._connected()
        if self._retries_not_found is None:
            try:
                reply = await self._call(
                    bus, SYSTEMD_BUS_NAME, MANAGER_PATH, PROPERTIES_INTERFACE, "Get", "ss", [MANAGER_INTERFACE, "Version"], what="Get"
                )
            except _DbusCallError as exc:
                raise ActivationError(f"systemd's version: {exc.text or exc.name}") from exc
            major = systemd_major_version(str(reply.body[0].value))
            self._retries_not_found = major is not None and major >= RETRIES_NOT_FOUND_SINCE
        return self._retries_not_found

    async def _load_unit(self, bus: MessageBus, unit: str) -> str | None:
        """The unit's object path once systemd looked at it; None when systemd
        refuses to load it at all (NoSuchUnit).

        LoadUnit rather than GetUnit: a unit that went inactive may already be
        unloaded (garbage-collected); loading it again reports its real
        LoadState instead of pretending it does not exist."""
        try:
            reply = await self._call(bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, "LoadUnit", "s", [unit], what="LoadUnit")
        except _DbusCallError as exc:
            if exc.name == NO_SUCH_UNIT:
                return None
            raise ActivationError(f"{unit}: {exc.text or exc.name}") from exc
        path: str = reply.body[0]
        return path

    async def _load_state(self, unit: str) -> str:
        """The unit's LoadState once systemd looked at it (`_load_unit`)."""
        bus = await self._connected()
        unit_path = await self._load_unit(bus, unit)
        if unit_path is None:
            return "not-found"
        try:
            state = await self._call(bus, SYSTEMD_BUS_NAME, unit_path, PROPERTIES_INTERFACE, "Get", "ss", [UNIT_INTERFACE, "LoadState"], what="Get")
        except _DbusCallError as exc:
            raise ActivationError(f"{unit}: {exc.text or exc.name}") from exc
        return str(state.body[0].value)

    async def _job_results(self, jobs: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """Each unit's job result ("done", "failed", ...) and, apart, the units
        whose job did not end within `job_timeout` (one wait for all of them), with why."""
        assert self._loop is not None and self._disconnected is not None
        waiters: dict[str, asyncio.Future[str]] = {}
        for unit, job_path in jobs.items():
            waiter: asyncio.Future[str] = self._loop.create_future()
            if job_path in self._finished_jobs:  # a fast job can finish before the reply reaches us
                waiter.set_result(self._finished_jobs.pop(job_path))
            else:
                self._job_waiters[job_path] = waiter
            waiters[unit] = waiter
        pending = {w for w in waiters.values() if not w.done()}
        try:
            # A lost connection (systemd re-executing, dbus restarting) ends the
            # wait at once instead of after job_timeout.
            deadline = time.monotonic() + self._job_timeout
            while pending and not self._disconnected.done():
                _, pending = await asyncio.wait(
                    {*pending, self._disconnected}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(self._disconnected)
                if time.monotonic() >= deadline:
                    break
        finally:
            for job_path in jobs.values():
                self._job_waiters.pop(job_path, None)
        results: dict[str, str] = {}
        unfinished: dict[str, str] = {}
        for unit, waiter in waiters.items():
            if waiter.done():
                results[unit] = waiter.result()
            else:
                waiter.cancel()
                if self._disconnected.done():
                    unfinished[unit] = "lost the connection to systemd while waiting for the job"
                else:
                    unfinished[unit] = f"job did not finish within {self._job_timeout:.0f} s"
        return results, unfinished

    async def _settled_outcome(self, unit: str, verb: UnitJob, result: str) -> dict[str, Any] | str:
        """The unit's settled properties after a job that did what was asked,
        else why it did not (a str)."""
        try:
            properties = await self._settled_properties(unit)
        except ActivationError as exc:
            return str(exc)
        if result != "done":
            return f"job {result}; {_describe(properties)}"
        if verb in ("start", "restart") and properties["ActiveState"] == "failed":
            return f"unit failed after its job finished; {_describe(properties)}"
        if verb == "reload" and properties["ActiveState"] != "active":
            # e.g. the program died of the reload signal instead of handling it
            return f"unit is no longer running after the reload; {_describe(properties)}"
        return properties

    async def _watch_startup(self, started: dict[str, dict[str, Any]]) -> dict[str, str]:
        """One startup grace for every started service at once: those that did
        not stay up, with why."""
        failures: dict[str, str] = {}
        watched = dict(started)
        deadline = time.monotonic() + self._startup_grace
        while watched and time.monotonic() < deadline:
            await asyncio.sleep(self._settle_poll_interval)
            units = list(watched)
            now = await asyncio.gather(*(self._unit_properties(unit) for unit in units), return_exceptions=True)
            for unit, properties in zip(units, now, strict=True):
                if isinstance(properties, ActivationError):
                    failures[unit] = str(properties)
                elif isinstance(properties, BaseException):
                    raise properties
                elif (
                    properties["ActiveState"] == "failed"
                    or properties["SubState"] == "auto-restart"
                    or properties["NRestarts"] > watched[unit]["NRestarts"]
                ):
                    failures[unit] = f"unit did not stay up after starting; {_describe(properties)}"
                else:
                    continue
                del watched[unit]
        return failures

    async def _settled_properties(self, unit: str) -> dict[str, Any]:
        deadline = time.monotonic() + self._settle_timeout
        while True:
            properties = await self._unit_properties(unit)
            if properties["ActiveState"] not in TRANSITIONAL_STATES:
                return properties
            if time.monotonic() >= deadline:
                raise ActivationError(f"still {properties['ActiveState']} after {self._settle_timeout:.0f} s; {_describe(properties)}")
            await asyncio.sleep(self._settle_poll_interval)

    async def _unit_properties(self, unit: str) -> dict[str, Any]:
        bus = await self._connected()
        unit_path = await self._load_unit(bus, unit)
        if unit_path is None:
            return {
                "ActiveState": "inactive",
                "SubState": "dead",
                "LoadState": "not-found",
                "Result": "",
                "MainPID": 0,
                "ExecMainStatus": 0,
                "NRestarts": 0,
                "InvocationID": "",
                "JobQueued": False,
            }
        unit_props = await self._get_all(bus, unit_path, UNIT_INTERFACE)
        properties: dict[str, Any] = {
            "ActiveState": unit_props["ActiveState"],
            "SubState": unit_props["SubState"],
            "LoadState": unit_props["LoadState"],
            "Result": "",
            "MainPID": 0,
            "ExecMainStatus": 0,
            "NRestarts": 0,
            # A new one on every run ("" before the first); Job is (0, "/") when none is queued.
            "InvocationID": bytes(unit_props["InvocationID"]).hex(),
            "JobQueued": unit_props["Job"][0] != 0,
        }
        if unit.endswith(".service"):
            service_props = await self._get_all(bus, unit_path, SERVICE_INTERFACE)
            properties["Result"] = service_props["Result"]
            properties["MainPID"] = service_props["MainPID"]
            properties["ExecMainStatus"] = service_props["ExecMainStatus"]
            properties["NRestarts"] = service_props["NRestarts"]
        return properties

    async def _get_all(self, bus: MessageBus, path: str, interface: str) -> dict[str, Any]:
        try:
            reply = await self._call(bus, SYSTEMD_BUS_NAME, path, PROPERTIES_INTERFACE, "GetAll", "s", [interface], what="GetAll")
        except _DbusCallError as exc:
            raise ActivationError(f"{path}: {exc.text or exc.name}") from exc
        return {name: variant.value for name, variant in reply.body[0].items()}


class _DbusCallError(Exception):
    def __init__(self, name: str, text: str, what: str) -> None:
        super().__init__(f"{what}: {name}: {text}")
        self.name = name
        self.text = text


def _describe(properties: dict[str, Any]) -> str:
    text = f"unit is {properties['ActiveState']} ({properties['SubState']})"
    if properties["LoadState"] != "loaded":
        text += f", load state {properties['LoadState']}"
    if properties["Result"] and properties["Result"] != "success":
        text += f", result {properties['Result']}"
        if properties["ExecMainStatus"]:
            text += f", exit status {properties['ExecMainStatus']}"
    return text


class UnitPassStarter:
    """`reconciler.ports.PassStarter`: fabric-reconcile.service (or `unit`)
    over one D-Bus connection, reopened after systemd or the bus restarted.

    A start is confirmed, not assumed: StartUnit returns a job even when
    systemd then runs nothing (the unit's start limit hit, a dependency
    failed), and a watcher that took the job for a pass would leave its
    change to the timer while its log said a pass was started."""

    def __init__(self, unit: str, bus_address: str | None = None, *, confirm_s: float = 5.0, poll_s: float = 0.02) -> None:
        self.unit = unit
        self._systemd = SystemdDbus(bus_address, follow_jobs=False)
        # How long a queued start job may wait (for the unit's After=
        # dependencies) before the start counts as taken: systemd runs it
        # once they are up.
        self.confirm_s = confirm_s
        self.poll_s = poll_s

    def pass_running(self) -> bool:
        return self._systemd.active_state(self.unit) in TRANSITIONAL_STATES

    def start_pass(self) -> None:
        """Queue the start, then wait until systemd began a run (a new
        InvocationID, or the unit in a transitional state) or, still
        queued, `confirm_s` passed. A job that ended without a run raises
        ActivationError naming the unit's state and result."""
        before = self._systemd.unit_properties(self.unit)["InvocationID"]
        self._systemd.enqueue_start(self.unit)
        deadline = time.monotonic() + self.confirm_s
        while True:
            now = self._systemd.unit_properties(self.unit)
            if now["InvocationID"] != before or now["ActiveState"] in TRANSITIONAL_STATES:
                return
            if not now["JobQueued"]:
                raise ActivationError(f"systemd ran no {self.unit}: its start job ended without a run ({_describe(now)})")
            if time.monotonic() >= deadline:
                return
            time.sleep(self.poll_s)

    def close(self) -> None:
        self._systemd.close()
