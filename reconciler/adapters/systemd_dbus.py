"""The `Systemd` port over systemd's D-Bus API (org.freedesktop.systemd1.Manager).

Every unit operation queues a job with mode "replace", waits for that job's
`JobRemoved` signal and its result, then waits for the unit to settle (leave
`activating`, `deactivating`, `reloading`) before returning, so the caller
knows what actually happened rather than what was asked for. A job that ends
in anything but "done", or a started unit that settles in `failed`, raises
`ActivationError` naming the unit, the job result and the unit's own state and
result (e.g. `exit-code`, status 1).

The methods are synchronous: the object owns a private asyncio event loop and
one bus connection, opened on first use and closed by `close()` (or `with`).
Do not call it from inside a running event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from reconciler.ports import ActivationError

SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_INTERFACE = "org.freedesktop.systemd1.Manager"
UNIT_INTERFACE = "org.freedesktop.systemd1.Unit"
SERVICE_INTERFACE = "org.freedesktop.systemd1.Service"
PROPERTIES_INTERFACE = "org.freedesktop.DBus.Properties"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"

# ActiveState values a unit only passes through; anything else is settled.
TRANSITIONAL_STATES = frozenset({"activating", "deactivating", "reloading", "refreshing"})

_JOB_REMOVED_MATCH = f"type='signal',sender='{SYSTEMD_BUS_NAME}',path='{MANAGER_PATH}',interface='{MANAGER_INTERFACE}',member='JobRemoved'"


class SystemdDbus:
    """`reconciler.ports.Systemd` for the system manager at `bus_address`.

    `bus_address` is a D-Bus address such as `unix:path=/run/dbus/system_bus_socket`;
    None means the system bus. `job_timeout` bounds the wait for one job (systemd's
    own start/stop timeouts normally end a job first); `settle_timeout` bounds the
    wait for the unit to leave a transitional state once its job is done.

    `startup_grace` (seconds, default 0) is how long a started or restarted
    service is watched after its job: a `Type=simple` service counts as started
    as soon as it is forked, so a program that exits at once would otherwise go
    unnoticed. Within the grace period a unit that fails or is being restarted
    by `Restart=` raises `ActivationError`.
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

    # -- the Systemd port -------------------------------------------------

    def daemon_reload(self) -> None:
        # Manager.Reload replies only once the reload is complete.
        self._run(self._call_manager("Reload", "", [], what="daemon-reload"))

    def start(self, unit: str) -> None:
        self._run(self._unit_job("StartUnit", "start", unit))

    def stop(self, unit: str) -> None:
        self._run(self._unit_job("StopUnit", "stop", unit))

    def restart(self, unit: str) -> None:
        self._run(self._unit_job("RestartUnit", "restart", unit))

    def reload(self, unit: str) -> None:
        self._run(self._unit_job("ReloadUnit", "reload", unit))

    def active_state(self, unit: str) -> str:
        return self._run(self._unit_properties(unit))["ActiveState"]

    # -- additions beyond the port (used by tests and diagnostics) ----------

    def unit_properties(self, unit: str) -> dict[str, Any]:
        """ActiveState, SubState, LoadState, Result, MainPID, ExecMainStatus, NRestarts of a unit.

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
        return self._loop.run_until_complete(coro)

    async def _connected(self) -> MessageBus:
        if self._bus is not None and self._bus.connected:
            return self._bus
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

    async def _unit_job(self, method: str, verb: str, unit: str) -> None:
        if not self._follow_jobs:
            raise ActivationError(f"{verb} {unit}: this systemd client does not follow jobs (follow_jobs=False)")
        bus = await self._connected()
        try:
            reply = await self._call(bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, method, "ss", [unit, "replace"], what=verb)
        except _DbusCallError as exc:
            if verb == "stop" and exc.name == NO_SUCH_UNIT:
                return  # an unknown unit is already stopped
            raise ActivationError(f"{verb} {unit}: {exc.text or exc.name}") from exc
        job_path: str = reply.body[0]
        result = await self._job_result(job_path, unit, verb)
        properties = await self._settled_properties(unit, verb)
        if result != "done":
            raise ActivationError(f"{verb} {unit}: job {result}; {_describe(properties)}")
        if verb in ("start", "restart") and properties["ActiveState"] == "failed":
            raise ActivationError(f"{verb} {unit}: unit failed after its job finished; {_describe(properties)}")
        if verb == "reload" and properties["ActiveState"] != "active":
            # e.g. the program died of the reload signal instead of handling it
            raise ActivationError(f"{verb} {unit}: unit is no longer running after the reload; {_describe(properties)}")
        if verb in ("start", "restart") and self._startup_grace > 0 and unit.endswith(".service"):
            await self._watch_startup(unit, verb, properties)

    async def _watch_startup(self, unit: str, verb: str, started: dict[str, Any]) -> None:
        deadline = time.monotonic() + self._startup_grace
        while time.monotonic() < deadline:
            await asyncio.sleep(self._settle_poll_interval)
            properties = await self._unit_properties(unit)
            crashed = (
                properties["ActiveState"] == "failed" or properties["SubState"] == "auto-restart" or properties["NRestarts"] > started["NRestarts"]
            )
            if crashed:
                raise ActivationError(f"{verb} {unit}: unit did not stay up after starting; {_describe(properties)}")

    async def _job_result(self, job_path: str, unit: str, verb: str) -> str:
        if job_path in self._finished_jobs:
            result = self._finished_jobs.pop(job_path)
        else:
            assert self._loop is not None
            waiter: asyncio.Future[str] = self._loop.create_future()
            self._job_waiters[job_path] = waiter
            assert self._disconnected is not None
            # A lost connection (systemd re-executing, dbus restarting) ends the wait
            # at once instead of after job_timeout.
            try:
                await asyncio.wait({waiter, self._disconnected}, timeout=self._job_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._job_waiters.pop(job_path, None)
            if not waiter.done():
                waiter.cancel()
                if self._disconnected.done():
                    raise ActivationError(f"{verb} {unit}: lost the connection to systemd while waiting for the job")
                raise ActivationError(f"{verb} {unit}: job did not finish within {self._job_timeout:.0f} s")
            result = waiter.result()
        # Jobs of other units (dependencies, other clients) also end up here;
        # operations are sequential, so nothing older is still wanted.
        self._finished_jobs.clear()
        return result

    async def _settled_properties(self, unit: str, verb: str) -> dict[str, Any]:
        deadline = time.monotonic() + self._settle_timeout
        while True:
            properties = await self._unit_properties(unit)
            if properties["ActiveState"] not in TRANSITIONAL_STATES:
                return properties
            if time.monotonic() >= deadline:
                raise ActivationError(f"{verb} {unit}: still {properties['ActiveState']} after {self._settle_timeout:.0f} s; {_describe(properties)}")
            await asyncio.sleep(self._settle_poll_interval)

    async def _unit_properties(self, unit: str) -> dict[str, Any]:
        bus = await self._connected()
        try:
            # LoadUnit rather than GetUnit: a unit that went inactive may already be
            # unloaded (garbage-collected); loading it again reports its real
            # LoadState instead of pretending it does not exist.
            reply = await self._call(bus, SYSTEMD_BUS_NAME, MANAGER_PATH, MANAGER_INTERFACE, "LoadUnit", "s", [unit], what="LoadUnit")
        except _DbusCallError as exc:
            if exc.name == NO_SUCH_UNIT:
                return {
                    "ActiveState": "inactive",
                    "SubState": "dead",
                    "LoadState": "not-found",
                    "Result": "",
                    "MainPID": 0,
                    "ExecMainStatus": 0,
                    "NRestarts": 0,
                }
            raise ActivationError(f"{unit}: {exc.text or exc.name}") from exc
        unit_path: str = reply.body[0]
        unit_props = await self._get_all(bus, unit_path, UNIT_INTERFACE)
        properties: dict[str, Any] = {
            "ActiveState": unit_props["ActiveState"],
            "SubState": unit_props["SubState"],
            "LoadState": unit_props["LoadState"],
            "Result": "",
            "MainPID": 0,
            "ExecMainStatus": 0,
            "NRestarts": 0,
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
    over one D-Bus connection, reopened after systemd or the bus restarted."""

    def __init__(self, unit: str, bus_address: str | None = None) -> None:
        self.unit = unit
        self._systemd = SystemdDbus(bus_address, follow_jobs=False)

    def pass_running(self) -> bool:
        return self._systemd.active_state(self.unit) in TRANSITIONAL_STATES

    def start_pass(self) -> None:
        self._systemd.enqueue_start(self.unit)

    def close(self) -> None:
        self._systemd.close()
