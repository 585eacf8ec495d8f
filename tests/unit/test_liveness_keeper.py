"""fabric-watch's liveness keeper (issue 30, reconciler.engine.watch.LivenessKeeper):
one keep-alive per interval, an outage said once, nothing else asked of the registry."""

from __future__ import annotations

from datetime import UTC, datetime

from reconciler.core.scheduling.suspicion import LivenessRecord
from reconciler.engine.watch import LivenessKeeper
from reconciler.ports import RegistryUnavailable


class KeepAliveOnly:
    """The `LivenessConnection` role: keep_alive and close, nothing more."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.down = False

    def keep_alive(self, host: str, ttl_s: float) -> LivenessRecord:
        if self.down:
            raise RegistryUnavailable("etcd: no endpoint answers")
        self.calls.append((host, ttl_s))
        return LivenessRecord(host, datetime.now(UTC), ttl_s)

    def close(self) -> None:
        pass


def test_the_keeper_keeps_alive_every_interval_and_says_an_outage_once():
    registry, log, waits = KeepAliveOnly(), [], []
    keeper = LivenessKeeper(registry, "lux", 2.0, 6.0, log=log.append)  # type: ignore[arg-type]

    def pause(seconds: float) -> None:
        waits.append(seconds)
        registry.down = len(waits) in (1, 2)
        if len(waits) == 4:
            keeper.stop()

    keeper.pause = pause
    keeper.run()
    assert registry.calls == [("lux", 6.0), ("lux", 6.0)], "before and after the two failed tries"
    assert waits == [2.0, 2.0, 2.0, 2.0], "never faster, never a pass"
    assert log == [
        "cannot keep lux's liveness record alive: etcd: no endpoint answers; trying again every 2 s",
        "lux's liveness record kept alive again",
    ]
