#!/usr/bin/env bash
# Join a systemd host that does not run NixOS to the fabric.
#
# Detects what the machine is (architecture, GPUs, storage, memory, Tailscale)
# and prints it, installs the reconciler into a virtual environment (default
# /opt/fabric) with pip, as a wheel built from a source checkout (or a wheel
# built elsewhere), writes /etc/fabric/node.toml, installs
# fabric-reconcile.service/.timer, fabric-watch.service,
# fabric-bootstrap.service (and fabric-leader.service on a leader candidate)
# exactly as `fabric units` renders them -- the same definitions the NixOS
# module declares -- enables the timer, the watcher and the bootstrap agent
# (it runs once, at the next boot, or now with --bootstrap: its stamp
# /var/lib/fabric/bootstrap.stamp keeps it from running again) and runs a
# first pass.
#
#   scripts/join.sh --source /path/to/fabric --host racknerd \
#       --git-remote git@github.com:researchstack/fleet.git --ssh-key-file /etc/fabric/deploy-key \
#       --ssh-host-key "$(ssh-keyscan -t ed25519 github.com 2>/dev/null | cut -d' ' -f2-)" \
#       --allowed-signers /etc/fabric/allowed_signers
#
# Offline: --wheelhouse DIR installs the dependencies from wheels in DIR only
# (make one elsewhere with `pip download -d DIR /path/to/fabric 'setuptools>=68'
# wheel`: the dependencies, and the build backend that turns a checkout into a
# wheel). Run it again at any time: it changes only what differs.
set -euo pipefail

PREFIX=/opt/fabric
CONFIG=/etc/fabric/node.toml
SYSTEMD_DIR=/etc/systemd/system
SOURCE=""
WHEELHOUSE=""
HOST=""
DESIRED=/var/lib/fabric/desired
UNIT_DIR=/etc/systemd/system
GIT_REMOTE=""
GIT_BRANCH=main
SSH_KEY_FILE=""
SSH_HOST_KEY=""
ALLOWED_SIGNERS=""
UNSIGNED_COMMITS=0
INTERVAL=30s
RANDOMIZED_DELAY=5s
LEADER=0
FIRST_PASS=1
DETECT_ONLY=0
BOOTSTRAP=0
TAILSCALE_AUTH_KEY_FILE=""
K3S_SERVER=""
K3S_TOKEN_FILE=""

usage() {
  cat <<'EOF'
usage: join.sh --source DIR|WHEEL [options]
  --source DIR|WHEEL         fabric source checkout to build and install (pyproject.toml,
                             reconciler/), or a fabric_reconciler-*.whl built from one
  --wheelhouse DIR           install dependencies (and, for a checkout, the build backend)
                             only from the wheels in DIR (offline)
  --prefix DIR               virtual environment to install into (default /opt/fabric)
  --host NAME                which host of the desired state this is (default: its hostname)
  --desired DIR              desired-state directory (default /var/lib/fabric/desired)
  --git-remote URL           fetch the desired state from git before each pass
  --git-branch NAME          branch to follow (default main)
  --ssh-key-file PATH        deploy key for the git remote (keep it where the pass unit reads
                             it under its hardening: /etc/fabric/deploy-key, not /root)
  --ssh-host-key 'TYPE KEY'  the ssh remote's host key, pinned (ssh-keyscan HOST | cut -d' ' -f2-);
                             required for an ssh remote
  --allowed-signers PATH     accept only commits signed by these keys (ssh allowed signers file);
                             required with --git-remote unless --unsigned-commits
  --unsigned-commits         accept unsigned commits: anyone who can push runs anything as root here
  --interval SPAN            time between passes (default 30s)
  --randomized-delay SPAN    random delay per pass (default 5s)
  --unit-dir DIR             where passes write rendered units (default /etc/systemd/system)
  --leader                   this host is a leader candidate: also fabric-leader.service
  --bootstrap                run the bootstrap agent (fabric-bootstrap.service) now; without
                             it, the agent runs at the next boot (once either way)
  --tailscale-auth-key-file PATH, --k3s-server URL, --k3s-token-file PATH
                             what the bootstrap needs (written to node.toml)
  --no-first-pass            enable the timer but do not run a pass now
  --detect-only              print what this machine is and exit

A fleet on etcd ([registry] backend = "etcd" in fabric.toml): the ca_file,
cert_file and key_file paths there are the same on every host, but each host
puts ITS OWN client certificate (CN = its host name, signed by the fleet's CA)
and key (root-only, 0600) at those paths before its first pass; with etcd's
auth on (`fabric registry init-auth`, run once with root's certificate, and
again after a host or a leader candidate is added) a host may write only its
own heartbeat. join.sh copies no certificate.
EOF
}

die() { echo "join.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --source) SOURCE=${2:?}; shift 2 ;;
    --wheelhouse) WHEELHOUSE=${2:?}; shift 2 ;;
    --prefix) PREFIX=${2:?}; shift 2 ;;
    --host) HOST=${2:?}; shift 2 ;;
    --desired) DESIRED=${2:?}; shift 2 ;;
    --git-remote) GIT_REMOTE=${2:?}; shift 2 ;;
    --git-branch) GIT_BRANCH=${2:?}; shift 2 ;;
    --ssh-key-file) SSH_KEY_FILE=${2:?}; shift 2 ;;
    --allowed-signers) ALLOWED_SIGNERS=${2:?}; shift 2 ;;
    --ssh-host-key) SSH_HOST_KEY=${2:?}; shift 2 ;;
    --unsigned-commits) UNSIGNED_COMMITS=1; shift ;;
    --interval) INTERVAL=${2:?}; shift 2 ;;
    --randomized-delay) RANDOMIZED_DELAY=${2:?}; shift 2 ;;
    --unit-dir) UNIT_DIR=${2:?}; shift 2 ;;
    --leader) LEADER=1; shift ;;
    --bootstrap) BOOTSTRAP=1; shift ;;
    --tailscale-auth-key-file) TAILSCALE_AUTH_KEY_FILE=${2:?}; shift 2 ;;
    --k3s-server) K3S_SERVER=${2:?}; shift 2 ;;
    --k3s-token-file) K3S_TOKEN_FILE=${2:?}; shift 2 ;;
    --no-first-pass) FIRST_PASS=0; shift ;;
    --detect-only) DETECT_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

# --------------------------------------------------------------------------
# What this machine is (the seed's join script, self-detecting). Printed for
# the operator; the reconciler's own probe is what the fleet uses.

detect() {
  local arch gpus="" storage mem_mib ts
  arch=$(uname -m)
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpus+="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/nvidia: /;s/$/; /' | tr -d '\n')"
  fi
  if [ -d /dev/dri ]; then
    local nodes
    nodes=$(find /dev/dri -maxdepth 1 -name 'renderD*' -printf '%f ' 2>/dev/null || true)
    [ -n "$nodes" ] && gpus+="render nodes: ${nodes% }; "
  fi
  if command -v lspci >/dev/null 2>&1; then
    gpus+="$(lspci 2>/dev/null | grep -Ei 'vga|3d controller|display controller' | sed 's/^[^ ]* [^:]*: //;s/$/; /' | tr -d '\n' || true)"
  fi
  storage=$(lsblk -d -n -o NAME,SIZE,ROTA,TRAN 2>/dev/null | awk '{t=($3=="0")?(($4=="nvme")?"nvme":"ssd"):"hdd"; printf "%s %s %s; ", $1, $2, t}' || true)
  mem_mib=$(awk '/^MemTotal:/ {printf "%d", $2/1024}' /proc/meminfo)
  if command -v tailscale >/dev/null 2>&1 && tailscale status >/dev/null 2>&1; then
    ts="up, $(tailscale ip -4 2>/dev/null | head -n1)"
  elif command -v tailscale >/dev/null 2>&1; then
    ts="installed, not up"
  else
    ts="not installed"
  fi
  echo "architecture: $arch"
  echo "gpus:         ${gpus:-none}"
  echo "storage:      ${storage:-unknown}"
  echo "memory:       ${mem_mib} MiB"
  echo "tailscale:    $ts"
}

echo "==> this machine"
detect
[ "$DETECT_ONLY" = 1 ] && exit 0

# --------------------------------------------------------------------------
# Checks before anything is touched.

[ "$(id -u)" = 0 ] || die "run as root (installs units into $SYSTEMD_DIR)"
[ -d /run/systemd/system ] || die "systemd is not running as init here"
[ -n "$SOURCE" ] || { usage >&2; die "--source DIR|WHEEL is required"; }
case "$SOURCE" in
  *.whl) [ -f "$SOURCE" ] || die "--source $SOURCE: no such wheel" ;;
  *) [ -f "$SOURCE/pyproject.toml" ] && [ -d "$SOURCE/reconciler" ] \
       || die "--source $SOURCE: not a fabric checkout (pyproject.toml, reconciler/) nor a wheel" ;;
esac
[ -z "$WHEELHOUSE" ] || [ -d "$WHEELHOUSE" ] || die "--wheelhouse $WHEELHOUSE: not a directory"
case "$PREFIX" in /*) ;; *) die "--prefix must be absolute" ;; esac
command -v python3 >/dev/null || die "python3 is needed (3.11 or newer)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "python3 is older than 3.11"

# --------------------------------------------------------------------------
# The package, in its own virtual environment.

echo "==> installing into $PREFIX"
[ -x "$PREFIX/bin/python" ] || python3 -m venv "$PREFIX"
pip_args=(--quiet --disable-pip-version-check --no-input)
if [ -n "$WHEELHOUSE" ]; then
  pip_args+=(--no-index --find-links "$WHEELHOUSE")
fi
# An installed package like any other: a wheel (its templates are package
# data, bin/fabric is its entry point), installed by pip with its dependencies.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
case "$SOURCE" in
  *.whl) wheel=$SOURCE ;;
  *)
    # pip builds the wheel (PEP 517, the backend pyproject.toml names) from a
    # copy of what the build reads, the files nix/package.nix builds from too:
    # nothing is written into the checkout, and no build/ left there by an
    # older build can leak removed modules into this one.
    mkdir "$build/src"
    cp -r "$SOURCE/pyproject.toml" "$SOURCE/README.md" "$SOURCE/reconciler" "$build/src/"
    find "$build/src" -name __pycache__ -prune -exec rm -rf {} +
    "$PREFIX/bin/python" -m pip wheel "${pip_args[@]}" --no-deps --wheel-dir "$build" "$build/src" \
      || die "could not build a wheel from $SOURCE (offline, --wheelhouse needs setuptools>=68 and wheel too)"
    wheel=$(echo "$build"/fabric_reconciler-*.whl)
    ;;
esac
site=$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$PREFIX/bin/python" -m pip show --quiet fabric-reconciler >/dev/null 2>&1; then
  # An older join.sh copied the sources in by hand, without metadata: pip is
  # to own every file of the package.
  rm -rf "$site/reconciler" "$site/templates" "$PREFIX/bin/fabric"
fi
# Its dependencies (and the package, the first time), then this very build
# even when its version is the one installed.
"$PREFIX/bin/python" -m pip install "${pip_args[@]}" "$wheel"
"$PREFIX/bin/python" -m pip install "${pip_args[@]}" --force-reinstall --no-deps "$wheel"
FABRIC="$PREFIX/bin/fabric"
"$FABRIC" --help >/dev/null

# --------------------------------------------------------------------------
# node.toml: this machine's part in the fleet (reconciler/core/install/nodeconfig.py).
# Written by Python so every value is quoted as TOML.

echo "==> $CONFIG"
mkdir -p "$(dirname "$CONFIG")"
JOIN_HOST=$HOST JOIN_DESIRED=$DESIRED JOIN_UNIT_DIR=$UNIT_DIR JOIN_INTERVAL=$INTERVAL \
JOIN_RANDOMIZED_DELAY=$RANDOMIZED_DELAY JOIN_GIT_REMOTE=$GIT_REMOTE JOIN_GIT_BRANCH=$GIT_BRANCH \
JOIN_SSH_KEY_FILE=$SSH_KEY_FILE JOIN_ALLOWED_SIGNERS=$ALLOWED_SIGNERS JOIN_SSH_HOST_KEY=$SSH_HOST_KEY JOIN_UNSIGNED_COMMITS=$UNSIGNED_COMMITS \
JOIN_TAILSCALE_AUTH_KEY_FILE=$TAILSCALE_AUTH_KEY_FILE JOIN_K3S_SERVER=$K3S_SERVER JOIN_K3S_TOKEN_FILE=$K3S_TOKEN_FILE \
"$PREFIX/bin/python" - "$CONFIG.new" <<'PY'
import json, os, sys, tempfile
e = {k.removeprefix("JOIN_").lower(): v for k, v in os.environ.items() if k.startswith("JOIN_")}
q = json.dumps  # a JSON string is a valid TOML basic string
lines = ["# Written by scripts/join.sh; see reconciler/core/install/nodeconfig.py.", "[node]"]
if e["host"]:
    lines.append(f"host = {q(e['host'])}")
lines += [f"desired = {q(e['desired'])}", f"unit_dir = {q(e['unit_dir'])}", "",
          "[timer]", f"interval = {q(e['interval'])}", f"randomized_delay = {q(e['randomized_delay'])}"]
if e["git_remote"]:
    lines += ["", "[source]", f"remote = {q(e['git_remote'])}", f"branch = {q(e['git_branch'])}"]
    if e["ssh_key_file"]:
        lines.append(f"ssh_key_file = {q(e['ssh_key_file'])}")
    if e["ssh_host_key"]:
        lines.append(f"ssh_host_key = {q(e['ssh_host_key'])}")
    # Signed commits unless --unsigned-commits says otherwise in so many words
    # (node.toml then refuses a [source] without allowed signers).
    if e["unsigned_commits"] == "1":
        lines.append("require_signed_commits = false")
    if e["allowed_signers"]:
        lines += ["require_signed_commits = true", f"allowed_signers_file = {q(e['allowed_signers'])}"]
boot = [k for k in ("tailscale_auth_key_file", "k3s_server", "k3s_token_file") if e[k]]
if boot:
    lines += ["", "[bootstrap]"] + [f"{k} = {q(e[k])}" for k in boot]
path = sys.argv[1]
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
with os.fdopen(fd, "w") as f:
    f.write("\n".join(lines) + "\n")
os.chmod(tmp, 0o644)
os.replace(tmp, path)
PY

# Check it before it replaces the old one: a bad value changes nothing.
leader_flag=()
[ "$LEADER" = 1 ] && leader_flag=(--leader-candidate)
if ! "$PREFIX/bin/fabric" units --config "$CONFIG.new" --fabric-bin "$PREFIX/bin/fabric" "${leader_flag[@]}" --json >/dev/null; then
  rm -f "$CONFIG.new"
  die "invalid settings (above); nothing installed into $SYSTEMD_DIR"
fi
mv -f "$CONFIG.new" "$CONFIG"

# Directories a pass writes: ProtectSystem=strict leaves only existing ones
# writable.
mkdir -p /etc/fabric /etc/rancher/k3s/config.yaml.d /etc/phaze /etc/sysusers.d /var/lib/node_exporter/textfile "$DESIRED"
if command -v caddy >/dev/null 2>&1; then mkdir -p /etc/caddy; fi

# node_exporter has no fixed textfile directory: Debian's
# prometheus-node-exporter reads /var/lib/prometheus/node-exporter (its build
# default) unless ARGS in /etc/default/prometheus-node-exporter names another
# with --collector.textfile.directory. Each pass writes
# /var/lib/node_exporter/textfile/fabric.prom (0644, atomically); a link in the
# directory node_exporter reads puts the fabric's series there without
# touching node_exporter's own settings.
TEXTFILE=/var/lib/node_exporter/textfile/fabric.prom
textfile_dir() {
  local defaults=/etc/default/prometheus-node-exporter args=""
  [ -f "$defaults" ] || { [ -d /var/lib/prometheus/node-exporter ] && echo /var/lib/prometheus/node-exporter; return 0; }
  args=$(sed -n 's/^ARGS=//p' "$defaults" | tail -n 1 | tr -d "\"'")
  case "$args" in
    *--collector.textfile.directory[=\ ]*)
      printf '%s\n' "$args" | sed -E 's/.*--collector\.textfile\.directory[= ]+([^ ]+).*/\1/' ;;
    *) echo /var/lib/prometheus/node-exporter ;;
  esac
}
exporter_dir=$(textfile_dir)
if [ -n "$exporter_dir" ] && [ "$exporter_dir" != "$(dirname "$TEXTFILE")" ]; then
  mkdir -p "$exporter_dir"
  ln -sfn "$TEXTFILE" "$exporter_dir/fabric.prom"
  echo "==> node_exporter reads $exporter_dir: $exporter_dir/fabric.prom -> $TEXTFILE"
fi

# --------------------------------------------------------------------------
# The units, rendered by the reconciler itself (reconciler/core/install/units.py).

echo "==> units"
# A pass of the old units may be running (the timer fired): let it end before
# the units change. Otherwise the first pass below merges into that run (a
# oneshot's start job does) and its result is reported for a pass of the old
# unit, without the new unit's ExecStartPre.
systemctl stop fabric-reconcile.timer 2>/dev/null || true
while [ "$(systemctl show -P ActiveState fabric-reconcile.service 2>/dev/null)" = activating ]; do
  sleep 0.2
done
units_args=(--config "$CONFIG" --fabric-bin "$FABRIC"
  --search-path "$PREFIX/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
"$FABRIC" units "${units_args[@]}" "${leader_flag[@]}" --write "$SYSTEMD_DIR"
systemctl daemon-reload
systemctl enable --now fabric-reconcile.timer
# Restarted so that it runs the program and unit just installed.
systemctl enable fabric-watch.service
systemctl restart fabric-watch.service
# The bootstrap agent: once, at the next boot (or below, with --bootstrap).
systemctl enable fabric-bootstrap.service
if [ "$LEADER" = 1 ]; then
  systemctl enable --now fabric-leader.service
fi

if [ "$BOOTSTRAP" = 1 ]; then
  echo "==> bootstrap (fabric-bootstrap.service)"
  # A oneshot: returns when it has ended; skipped once its stamp exists.
  if ! systemctl start fabric-bootstrap.service; then
    echo "the bootstrap failed (no stamp: it runs again at the next boot): journalctl -u fabric-bootstrap.service" >&2
    exit 1
  fi
fi

if [ "$FIRST_PASS" = 1 ]; then
  echo "==> first pass"
  # A oneshot: returns when the pass has ended.
  if systemctl start fabric-reconcile.service; then
    echo "pass succeeded; every ${INTERVAL} from now on (journalctl -t fabric-reconcile)"
  else
    echo "the first pass failed: journalctl -t fabric-reconcile -n 50" >&2
    exit 1
  fi
fi
echo "fabric-reconcile.timer: $(systemctl is-active fabric-reconcile.timer)"
