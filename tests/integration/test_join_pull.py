"""fabric pull (fabric-reconcile's ExecStartPre) against real git repositories.

A local bare repository stands in for the fleet's remote. Signed commits are
real SSH signatures (ssh-keygen keys, gpg.format=ssh).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from reconciler.cli import main
from reconciler.core.install.fetching import FETCH_EVERY_INTERVALS, FETCHED
from reconciler.core.live.watching import PASS_ASKED, moment_record
from tests.conftest import EXAMPLE_FLEET, require

pytestmark = pytest.mark.integration


def git(*args: str, cwd: Path) -> str:
    env = {
        "GIT_AUTHOR_NAME": "op",
        "GIT_AUTHOR_EMAIL": "op@fleet",
        "GIT_COMMITTER_NAME": "op",
        "GIT_COMMITTER_EMAIL": "op@fleet",
        "HOME": str(cwd),
        "PATH": "/usr/bin:/bin",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def fleet(tmp_path: Path) -> dict[str, Path]:
    require("git", "ssh-keygen")
    remote = tmp_path / "fleet.git"
    work = tmp_path / "work"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(remote), cwd=tmp_path)
    git("init", "--quiet", "--initial-branch=main", str(work), cwd=tmp_path)
    for toml in EXAMPLE_FLEET.glob("*.toml"):
        (work / toml.name).write_text(toml.read_text())
    key = tmp_path / "signer"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    git("config", "gpg.format", "ssh", cwd=work)
    git("config", "user.signingkey", str(key), cwd=work)
    git("add", ".", cwd=work)
    git("commit", "--quiet", "-S", "-m", "fleet", cwd=work)
    git("remote", "add", "origin", str(remote), cwd=work)
    git("push", "--quiet", "origin", "main", cwd=work)
    signers = tmp_path / "allowed_signers"
    signers.write_text(f"op@fleet {(tmp_path / 'signer.pub').read_text()}")
    return {"remote": remote, "work": work, "signers": signers, "root": tmp_path}


def node_toml(fleet: dict[str, Path], *, signed: bool) -> Path:
    root = fleet["root"]
    text = f"""
[node]
desired = "{root}/state/desired"
state_dir = "{root}/state"
[source]
remote = "{fleet["remote"]}"
branch = "main"
"""
    if signed:
        text += f'require_signed_commits = true\nallowed_signers_file = "{fleet["signers"]}"\n'
    else:  # the gate is on by default: off only in so many words
        text += "require_signed_commits = false\n"
    path = root / "node.toml"
    path.write_text(text)
    return path


def test_clone_then_fetch_follows_the_branch(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config = node_toml(fleet, signed=False)
    desired = fleet["root"] / "state" / "desired"
    assert main(["pull", "--config", str(config)]) == 0
    assert (desired / "fabric.toml").read_text() == (EXAMPLE_FLEET / "fabric.toml").read_text()
    assert main(["pull", "--config", str(config)]) == 0
    assert "up to date" in capsys.readouterr().out

    (fleet["work"] / "NOTE").write_text("changed\n")
    git("add", "NOTE", cwd=fleet["work"])
    git("commit", "--quiet", "-m", "note", cwd=fleet["work"])
    git("push", "--quiet", "origin", "main", cwd=fleet["work"])
    assert main(["pull", "--config", str(config)]) == 0
    assert (desired / "NOTE").read_text() == "changed\n"
    # The checkout is a valid desired state for the pass.
    assert main(["validate", "--desired", str(desired)]) == 0


def test_unsigned_commit_is_refused_and_the_last_good_one_kept(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config = node_toml(fleet, signed=True)
    desired = fleet["root"] / "state" / "desired"
    assert main(["pull", "--config", str(config)]) == 0
    good = git("rev-parse", "HEAD", cwd=desired)

    (fleet["work"] / "fabric.toml").write_text("[fleet]\ninjected = true\n")
    git("commit", "--quiet", "-am", "unsigned", cwd=fleet["work"])
    git("push", "--quiet", "origin", "main", cwd=fleet["work"])
    capsys.readouterr()
    assert main(["pull", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "not signed by an allowed signer" in err and "keeping the last good commit" in err
    assert git("rev-parse", "HEAD", cwd=desired) == good
    assert (desired / "fabric.toml").read_text() == (EXAMPLE_FLEET / "fabric.toml").read_text()

    # A signed fix is taken.
    (fleet["work"] / "fabric.toml").write_text((EXAMPLE_FLEET / "fabric.toml").read_text() + "\n# signed\n")
    git("commit", "--quiet", "-S", "-am", "signed", cwd=fleet["work"])
    git("push", "--quiet", "origin", "main", cwd=fleet["work"])
    assert main(["pull", "--config", str(config)]) == 0
    assert (desired / "fabric.toml").read_text().endswith("# signed\n")


def test_a_force_pushed_older_signed_commit_is_refused_until_an_operator_accepts_the_rewind(
    fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = node_toml(fleet, signed=True)
    desired = fleet["root"] / "state" / "desired"
    assert main(["pull", "--config", str(config)]) == 0
    old = git("rev-parse", "HEAD", cwd=desired)
    (fleet["work"] / "fabric.toml").write_text((EXAMPLE_FLEET / "fabric.toml").read_text() + "\n# newer\n")
    git("commit", "--quiet", "-S", "-am", "newer", cwd=fleet["work"])
    git("push", "--quiet", "origin", "main", cwd=fleet["work"])
    assert main(["pull", "--config", str(config)]) == 0
    newer = git("rev-parse", "HEAD", cwd=desired)
    assert newer != old

    # Someone with push access rewinds the branch to the older (still signed) commit.
    git("push", "--quiet", "--force", "origin", f"{old}:refs/heads/main", cwd=fleet["work"])
    capsys.readouterr()
    assert main(["pull", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert f"commit {old[:12]} does not descend from {newer[:12]}, the commit this host runs (a rewind or a force-push)" in err
    assert "keeping the last good commit" in err
    assert git("rev-parse", "HEAD", cwd=desired) == newer

    # The operator takes it, explicitly.
    assert main(["pull", "--config", str(config), "--accept-rewind"]) == 0
    assert git("rev-parse", "HEAD", cwd=desired) == old


def test_an_unsigned_desired_state_is_said_on_every_pull(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config = node_toml(fleet, signed=False)
    assert main(["pull", "--config", str(config)]) == 0
    assert "unsigned commits are accepted (node.toml [source] require_signed_commits = false)" in capsys.readouterr().err


def test_unreachable_remote_keeps_the_checkout(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config = node_toml(fleet, signed=False)
    assert main(["pull", "--config", str(config)]) == 0
    fleet["remote"].rename(fleet["root"] / "gone.git")
    assert main(["pull", "--config", str(config)]) == 0
    assert "cannot fetch" in capsys.readouterr().err
    assert (fleet["root"] / "state" / "desired" / "fabric.toml").exists()


def test_nothing_to_fall_back_to_fails(fleet: dict[str, Path]) -> None:
    config = node_toml(fleet, signed=False)
    fleet["remote"].rename(fleet["root"] / "gone.git")
    assert main(["pull", "--config", str(config)]) == 1
    assert not (fleet["root"] / "state" / "desired").exists()


def test_bad_node_toml_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[source]\nremote = "/srv/fleet.git"\nrequire_signed_commits = true\n')
    assert main(["pull", "--config", str(config)]) == 2
    assert f"{config}: source.allowed_signers_file: required: commits must be signed" in capsys.readouterr().err


def ask_for_a_pass(fleet: dict[str, Path], at: float | None = None) -> Path:
    """fabric-watch's ask for the next pass, in node.state_dir, as it leaves it before a start."""
    ask = fleet["root"] / "state" / PASS_ASKED
    ask.parent.mkdir(exist_ok=True)
    ask.write_bytes(moment_record(time.time() if at is None else at))
    return ask


def test_a_pass_the_watcher_asked_for_is_not_kept_waiting_by_the_remote(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The reacting pass renders from the checkout it has, even with the remote
    gone (no fetch tried, so no timeout waited for); the next start without an
    ask (the timer's) tries, and says the remote cannot be reached."""
    config = node_toml(fleet, signed=False)
    assert main(["pull", "--config", str(config)]) == 0
    head = git("rev-parse", "HEAD", cwd=fleet["root"] / "state" / "desired")
    fleet["remote"].rename(fleet["root"] / "gone.git")
    ask = ask_for_a_pass(fleet)
    capsys.readouterr()
    assert main(["pull", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("pull: not fetching: fabric-watch asked for this pass") and out.rstrip().endswith(f"staying at {head[:12]}")
    assert err == "" and not ask.exists()
    assert main(["pull", "--config", str(config)]) == 0
    assert "cannot fetch" in capsys.readouterr().err


def test_an_asked_pass_fetches_when_the_last_fetch_is_stale_or_there_is_no_checkout(
    fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = node_toml(fleet, signed=False)
    desired = fleet["root"] / "state" / "desired"
    ask_for_a_pass(fleet)
    assert main(["pull", "--config", str(config)]) == 0, "no checkout yet: the ask cannot spare the clone"
    assert (desired / "fabric.toml").exists()

    (fleet["work"] / "NOTE").write_text("changed\n")
    git("add", "NOTE", cwd=fleet["work"])
    git("commit", "--quiet", "-m", "note", cwd=fleet["work"])
    git("push", "--quiet", "origin", "main", cwd=fleet["work"])
    # The last fetch two timer intervals ago (node.toml's default 30 s): the
    # watcher's passes have kept the timer from firing that long.
    (fleet["root"] / "state" / FETCHED).write_bytes(moment_record(time.time() - FETCH_EVERY_INTERVALS * 30))
    ask_for_a_pass(fleet)
    capsys.readouterr()
    assert main(["pull", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("pull: now at")
    assert (desired / "NOTE").read_text() == "changed\n"
