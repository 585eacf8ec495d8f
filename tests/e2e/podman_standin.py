#!/usr/bin/python3
"""A stand-in for /usr/bin/podman inside the e2e fleet's containers (never on the host).

The lane agents the fabric renders are the seed's phaze images, run by podman
(`podman run --detach --sdnotify=conmon ...`: podman exits, conmon stays as the
unit's main process and tells systemd it is ready). This machine has neither
podman nor the images, so tests/e2e/fleet.py installs this script as
/usr/bin/podman in each container: `run` leaves an idle process that reports
READY=1 with itself as MAINPID, exactly the protocol the rendered unit
(Type=notify, NotifyAccess=all) expects; `stop` and `rm` have nothing to do
(systemd stops the unit's cgroup). The lane units therefore start, stay up and
stop as they would with the real agent; what runs inside is not the agent.
"""

import os
import socket
import sys
import time


def notify(message: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "run":
        return 0  # stop, rm: the unit's cgroup is stopped by systemd
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        # The notifying process stays alive (it becomes the idle main process),
        # so systemd can always tell which unit the message came from.
        notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=stand-in for {argv[-1]}")
        os.write(write_end, b"x")
        os.close(write_end)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.execvp("sleep", ["sleep", "infinity"])
    os.close(write_end)
    os.read(read_end, 1)
    time.sleep(0.2)  # let systemd take MAINPID before `podman run` exits
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
