"""`fabric admit HOST` against a real desired-state git repository (#31 item 3).

A checkout of the example fleet in tmp with a bare remote, a real sqlite
registry holding the machine's pending report, and the command line: the
commit holds exactly the new host file, the tree at that commit validates,
`--push` reaches the remote; where the checkout requires signed commits
(git config commit.gpgsign, or node.toml's [source] require_signed_commits)
the commit is signed with the checkout's ssh signing key and `git
verify-commit` accepts it against the allowed signers; a signing failure
leaves nothing written.
"""

from __future__ import annotations

import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.core.desired.load import load_desired
from reconciler.core.live.pending import PendingRecord
from reconciler.core.probe import RawCapture, facts_from_capture
from tests.conftest import EXAMPLE_FLEET, REPO, require
from tests.support.cli import fabric_captured

pytestmark = pytest.mark.integration

NEW = "newbox"


class WallClock:
    def now(self) -> float:
        return time.time()


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    require("git", "ssh-keygen")
    for name, value in {
        "GIT_AUTHOR_NAME": "op",
        "GIT_AUTHOR_EMAIL": "op@fleet",
        "GIT_COMMITTER_NAME": "op",
        "GIT_COMMITTER_EMAIL": "op@fleet",
        "HOME": str(tmp_path),
        "GIT_CONFIG_NOSYSTEM": "1",
    }.items():
        monkeypatch.setenv(name, value)
    remote, work = tmp_path / "fleet.git", tmp_path / "work"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(remote), cwd=tmp_path)
    git("init", "--quiet", "--initial-branch=main", str(work), cwd=tmp_path)
    for toml in EXAMPLE_FLEET.glob("*.toml"):
        (work / toml.name).write_text(toml.read_text())
    git("add", ".", cwd=work)
    git("commit", "--quiet", "-m", "fleet", cwd=work)
    git("remote", "add", "origin", str(remote), cwd=work)
    git("push", "--quiet", "--set-upstream", "origin", "main", cwd=work)
    # The machine's pending report, as its pass left it.
    registry_path = tmp_path / "reg" / "registry.sqlite"
    fleet = load_desired(work).fleet
    outputs, errors = CaptureDirectory().load(str(REPO / "tests" / "fixtures" / "probe" / "radeon-desktop"))
    facts = facts_from_capture(RawCapture(outputs, errors), host=NEW).model_copy(update={"tailscale_ip": "100.101.9.9"})
    registry = SqliteRegistry(registry_path, timing=fleet.timing, flap=fleet.flap, clock=WallClock())
    try:
        registry.report_pending(PendingRecord(node_id=NEW, facts=facts), ttl_s=3600)
    finally:
        registry.close()
    return {"work": work, "remote": remote, "registry": registry_path, "root": tmp_path}


def signing_key(checkout: dict[str, Path]) -> Path:
    key = checkout["root"] / "signer"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    git("config", "gpg.format", "ssh", cwd=checkout["work"])
    git("config", "user.signingkey", str(key), cwd=checkout["work"])
    signers = checkout["root"] / "allowed_signers"
    signers.write_text(f"op@fleet {(checkout['root'] / 'signer.pub').read_text()}")
    return signers


def admit(checkout: dict[str, Path], *extra: str, node_config: Path | None = None) -> tuple[int, str, str]:
    return fabric_captured(
        "admit",
        NEW,
        "--desired",
        str(checkout["work"]),
        "--registry-path",
        str(checkout["registry"]),
        "--node-config",
        str(node_config or checkout["root"] / "no-node.toml"),
        *extra,
    )


def test_admit_commits_the_host_file_that_validates_and_pushes_it(checkout: dict[str, Path]) -> None:
    work = checkout["work"]
    before = git("rev-parse", "HEAD", cwd=work)
    status, out, err = admit(checkout, "--role", "compute", "--push")
    assert status == EXIT_OK, out + err
    assert f"+++ b/{NEW}.toml" in out and "+# probed tier: gpu_vaapi" in out, out
    head = git("rev-parse", "HEAD", cwd=work)
    assert git("rev-parse", "HEAD~1", cwd=work) == before
    assert git("diff", "--name-only", before, head, cwd=work).splitlines() == [f"{NEW}.toml"]
    assert git("status", "--porcelain", cwd=work) == ""
    assert git("rev-parse", "main", cwd=checkout["remote"]) == head, "--push reached the remote"
    desired = load_desired(work)
    assert desired.hosts[NEW].host.address == "100.101.9.9" and desired.hosts[NEW].host.roles == ["compute"]
    assert "(signed)" not in out


def test_a_leader_candidate_is_committed_in_fabric_toml_too(checkout: dict[str, Path]) -> None:
    work = checkout["work"]
    status, out, err = admit(checkout, "--leader-candidate")
    assert status == EXIT_OK, out + err
    assert sorted(git("diff", "--name-only", "HEAD~1", "HEAD", cwd=work).splitlines()) == ["fabric.toml", f"{NEW}.toml"]
    assert NEW in tomllib.loads((work / "fabric.toml").read_text())["fleet"]["leader_candidates"]
    assert NEW in load_desired(work).fleet.fleet.leader_candidates


def test_where_the_checkout_signs_its_commits_the_admission_is_signed(checkout: dict[str, Path]) -> None:
    signers = signing_key(checkout)
    git("config", "commit.gpgsign", "true", cwd=checkout["work"])
    status, out, err = admit(checkout)
    assert status == EXIT_OK, out + err
    assert "(signed)" in out
    verified = subprocess.run(
        ["git", "-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={signers}", "verify-commit", "HEAD"],
        cwd=checkout["work"],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stderr


def test_node_toml_requiring_signed_commits_signs_and_without_a_key_nothing_stays(checkout: dict[str, Path]) -> None:
    root, work = checkout["root"], checkout["work"]
    node = root / "node.toml"
    node.write_text(
        f'[node]\ndesired = "{root}/state/desired"\nstate_dir = "{root}/state"\n'
        f'[source]\nremote = "{checkout["remote"]}"\nrequire_signed_commits = true\nallowed_signers_file = "{root}/allowed_signers"\n'
    )
    before = git("rev-parse", "HEAD", cwd=work)
    # No signing key configured: git cannot sign; nothing is written, nothing staged.
    git("config", "gpg.format", "ssh", cwd=work)
    status, out, err = admit(checkout, node_config=node)
    assert status == EXIT_FAILED, out + err
    assert git("rev-parse", "HEAD", cwd=work) == before
    assert git("status", "--porcelain", cwd=work) == "" and not (work / f"{NEW}.toml").exists()
    signers = signing_key(checkout)
    status, out, err = admit(checkout, node_config=node)
    assert status == EXIT_OK and "(signed)" in out, out + err
    verified = subprocess.run(
        ["git", "-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={signers}", "verify-commit", "HEAD"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stderr


def test_a_second_admission_of_the_same_name_is_refused(checkout: dict[str, Path]) -> None:
    assert admit(checkout)[0] == EXIT_OK
    head = git("rev-parse", "HEAD", cwd=checkout["work"])
    status, out, err = admit(checkout)
    assert status == EXIT_INVALID and "collides" in err, out + err
    assert git("rev-parse", "HEAD", cwd=checkout["work"]) == head
