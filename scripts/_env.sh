# Shared by scripts/demo and scripts/test: a project virtual environment with
# the package installed, and (as root) the Debian packages the real-component
# tests and the demo use. Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FABRIC_VENV:-$ROOT/.venv}"

# Debian packages: nft, socat, caddy, etcd, systemd-nspawn/dbus for systemd as
# PID 1 in a container, iproute2 for namespaces, nix for evaluating the module,
# chromium (status page), prometheus (promtool) and prometheus-node-exporter
# (the metrics textfile), pciutils (lspci for the hardware probe), podman with
# crun and catatonit (its rootless pause process; named, as they are only
# alternatives or recommends) for the agent units, busybox-static for the image
# tests/integration/test_agent_podman.py builds, rsync (phaze's push into a
# lane's scratch dir, which that test makes as phaze does), postgresql
# (phaze's broker for the lane queue: tests/support/harness/postgres.py, scripts/demo), strace
# (the atomic write's system calls: tests/integration/test_atomic_write_syscalls.py).
DEBIAN_PACKAGES=(nftables socat caddy etcd-server etcd-client systemd-container dbus iproute2 nix-bin python3-venv git chromium prometheus prometheus-node-exporter pciutils curl podman crun catatonit busybox-static rsync postgresql strace)

install_debian_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "not root: cannot install ${missing[*]}; tests needing them will fail under CI=true" >&2
    return 0
  fi
  echo "==> apt-get install ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

ensure_venv() {  # ensure_venv [EXTRAS]: the package (with these extras of pyproject.toml)
  local extras="${1:-}" target="$ROOT"
  [ -z "$extras" ] || target="$ROOT[$extras]"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV" >&2
    python3 -m venv "$VENV"
  fi
  # Reinstall only when pyproject.toml changed since the last install.
  local stamp="$VENV/.fabric-installed-${extras:-package}"
  if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "==> pip install -e .${extras:+[$extras]}" >&2
    # (This machine's pip.conf names local indexes that may be absent; pip
    # warns once per package about them, which says nothing about us.)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$target" 2>&1 \
      | { grep -v '^WARNING: Location .* is ignored' || true; } >&2
    touch "$stamp"
  fi
}
