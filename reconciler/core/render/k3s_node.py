"""The k3s Node's labels, kept equal to the fabric's drop-in (pure).

k3s reads `config.yaml.d/50-fabric-labels.yaml` only when it starts, and then
adds or overwrites each label and never removes one (`configureNode` and
`updateMutableLabels` in k3s-io/k3s pkg/agent/run.go: `labels.Merge(node, wanted)`).
So after the drop-in changes the fabric sets the Node's labels itself, through
the Kubernetes API with the kubelet's own credentials, as k3s's agent does
(`coreClient(nodeConfig.AgentConfig.KubeConfigKubelet)`): a JSON merge patch
that sets every label of the drop-in and removes (null) every label the fabric
owns that the drop-in no longer has. The fabric owns its probe's prefix and
every key an earlier drop-in of its own set; other labels are left alone.

A `--node-label` on k3s's command line beats every config file (k3s's docs:
flags override config.yaml values), so a label the fabric sets can come back
at k3s's next start: `command_line_labels` finds them for the pass to report.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reconciler.core.probe.tiering import LABEL_PREFIX

# k3s's default data directory; its agent writes the kubelet's kubeconfig
# there (pkg/agent/config/config.go: <data-dir>/agent/kubelet.kubeconfig).
KUBELET_KUBECONFIG = "/var/lib/rancher/k3s/agent/kubelet.kubeconfig"

# One label of our own drop-in: `  - "key=value"` (templates/k3s-labels.yaml.j2).
_DROPIN_LABEL_RE = re.compile(r'^\s*-\s*"([^"=]+)=([^"]*)"\s*$')
# k3s writes kubeconfigs from one Go template (pkg/daemons/control/deps
# KubeConfig): a key and a path or URL on a line of their own.
_KUBECONFIG_RE = re.compile(r"^\s*(server|certificate-authority|client-certificate|client-key):\s*(\S+)\s*$", re.M)


class KubeconfigError(ValueError):
    """A kubeconfig k3s did not write: the reason, never the file's content."""


@dataclass(frozen=True)
class KubeletAccess:
    """What a client needs to speak as this node's kubelet."""

    server: str  # https://127.0.0.1:6444 (the agent's load balancer)
    certificate_authority: str
    client_certificate: str
    client_key: str


def parse_kubeconfig(text: str) -> KubeletAccess:
    found: dict[str, str] = {}
    for key, value in _KUBECONFIG_RE.findall(text):
        found.setdefault(key, value)
    missing = [k for k in ("server", "certificate-authority", "client-certificate", "client-key") if k not in found]
    if missing:
        raise KubeconfigError(f"no {', '.join(missing)} (not a kubeconfig k3s wrote: embedded credentials are not read)")
    if not found["server"].startswith("https://"):
        raise KubeconfigError("server is not an https:// URL")
    for key in ("certificate-authority", "client-certificate", "client-key"):
        if not found[key].startswith("/"):
            raise KubeconfigError(f"{key} is not an absolute path")
    return KubeletAccess(found["server"], found["certificate-authority"], found["client-certificate"], found["client-key"])


def dropin_labels(text: str | None) -> dict[str, str]:
    """The labels of a drop-in the fabric rendered (none for None)."""
    labels: dict[str, str] = {}
    for line in (text or "").splitlines():
        match = _DROPIN_LABEL_RE.match(line)
        if match:
            labels[match.group(1)] = match.group(2)
    return labels


def label_patch(node: Mapping[str, str], wanted: Mapping[str, str], previous: Mapping[str, str]) -> dict[str, str | None]:
    """The labels to set (value) and to remove (None) so that the Node carries
    `wanted` and none of the fabric's other labels: those under its prefix and
    those its `previous` drop-in set. Empty: the Node is as it should be."""
    patch: dict[str, str | None] = {key: value for key, value in wanted.items() if node.get(key) != value}
    owned = {key for key in node if key.startswith(LABEL_PREFIX)} | set(previous)
    for key in sorted(owned - set(wanted)):
        if key in node:
            patch[key] = None
    return dict(sorted(patch.items()))


def merge_patch_body(patch: Mapping[str, str | None]) -> dict[str, object]:
    """The JSON merge patch (RFC 7386) of a Node's labels: null deletes a key."""
    return {"metadata": {"labels": dict(patch)}}


def command_line_labels(argv: Sequence[str]) -> list[str]:
    """The `key=value` of each --node-label on a k3s command line (`k3s agent ...`, `k3s server ...`)."""
    if not argv or not argv[0].rsplit("/", 1)[-1].startswith("k3s"):
        return []
    labels: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--node-label="):
            labels.append(arg.split("=", 1)[1])
        elif arg == "--node-label" and i + 1 < len(argv):
            labels.append(argv[i + 1])
    return labels


def overridden(command_line: Sequence[str], wanted: Mapping[str, str]) -> list[str]:
    """The drop-in's labels that a command-line --node-label of another value overrides."""
    given = dict(label.partition("=")[::2] for label in command_line)
    return sorted(f"{key}={given[key]} (drop-in: {value})" for key, value in wanted.items() if key in given and given[key] != value)
