#!/usr/bin/python3
"""A stand-in for /usr/bin/podman inside the e2e fleet's containers (never on the host).

The lane agents the fabric renders are the seed's phaze images, run by
rootless podman (`podman run --detach --conmon-pidfile=PATH ...`: podman exits
once the container runs, and conmon, whose PID it wrote to PATH, stays as the
unit's main process; the unit is Type=forking with PIDFile=PATH). The e2e
fleet cannot pull those images, so tests/e2e/fleet.py installs this script as
/usr/bin/podman in each container: `run` leaves an idle process, writes its
PID where `--conmon-pidfile=` says and exits, exactly the protocol the rendered
unit expects; `stop` and `rm` have nothing to do (systemd stops the unit's
cgroup). The lane units therefore start, stay up and stop as they would with
the real agent; what runs inside is not the agent. Real podman runs the same
unit in tests/integration/test_agent_podman.py.
"""

import os
import sys


def main(argv: list[str]) -> int:
    if "run" not in argv:
        return 0  # stop, rm: the unit's cgroup is stopped by systemd
    pidfile = next((a.split("=", 1)[1] for a in argv if a.startswith("--conmon-pidfile=")), None)
    if pidfile is None:
        print("podman stand-in: run without --conmon-pidfile=", file=sys.stderr)
        return 125
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(write_end)  # the parent's read returns: this process is set up
        os.execvp("sleep", ["sleep", "infinity"])
    os.close(write_end)
    os.read(read_end, 1)
    # Written before `run` exits, as podman does: systemd reads it then.
    with open(pidfile + ".tmp", "w") as out:
        out.write(f"{child}\n")
    os.rename(pidfile + ".tmp", pidfile)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
