"""The k3s Node's labels follow the drop-in (pure rules of reconciler.core.render.k3s_node)."""

from __future__ import annotations

import pytest

from reconciler.core.render.k3s_node import (
    KubeconfigError,
    command_line_labels,
    dropin_labels,
    label_patch,
    merge_patch_body,
    overridden,
    parse_kubeconfig,
)
from tests.support.k3s import KUBELET_KUBECONFIG

K3S_KUBELET_KUBECONFIG = KUBELET_KUBECONFIG

P = "topology.researchstack.io/"
DROPIN = f'''# Written by fabric-reconcile for host qfox-1: do not edit.
node-label+:
  - "{P}tier=gpu_cuda"
  - "{P}gpu=nvidia-rtx4070"
  - "site=basement"
'''


def test_the_kubelets_kubeconfig_k3s_writes_names_its_server_and_credential_files():
    access = parse_kubeconfig(K3S_KUBELET_KUBECONFIG)
    assert access.server == "https://127.0.0.1:6444"
    assert access.certificate_authority == "/var/lib/rancher/k3s/agent/server-ca.crt"
    assert (access.client_certificate, access.client_key) == (
        "/var/lib/rancher/k3s/agent/client-kubelet.crt",
        "/var/lib/rancher/k3s/agent/client-kubelet.key",
    )


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "no server"),
        (K3S_KUBELET_KUBECONFIG.replace("client-key: /var", "client-key-data: AAAA"), "no client-key"),
        (K3S_KUBELET_KUBECONFIG.replace("https://", "http://"), "not an https:// URL"),
        (K3S_KUBELET_KUBECONFIG.replace("client-certificate: /var", "client-certificate: var"), "not an absolute path"),
    ],
)
def test_a_kubeconfig_k3s_did_not_write_is_refused_with_its_reason(text, reason):
    with pytest.raises(KubeconfigError, match=reason):
        parse_kubeconfig(text)


def test_the_drop_ins_labels_are_read_back():
    assert dropin_labels(DROPIN) == {f"{P}tier": "gpu_cuda", f"{P}gpu": "nvidia-rtx4070", "site": "basement"}
    assert dropin_labels(None) == {}


def test_changed_labels_are_set_and_a_probe_label_that_left_is_removed():
    node = {f"{P}tier": "gpu_apu", f"{P}gpu": "nvidia-rtx4070", f"{P}storage": "nvme", "kubernetes.io/hostname": "qfox-1"}
    wanted = {f"{P}tier": "gpu_cuda", f"{P}gpu": "nvidia-rtx4070"}
    assert label_patch(node, wanted, previous={}) == {f"{P}storage": None, f"{P}tier": "gpu_cuda"}


def test_a_host_file_label_the_last_drop_in_set_is_removed_and_others_labels_stay():
    node = {"site": "basement", "team": "video", f"{P}tier": "gpu_cuda"}
    patch = label_patch(node, {f"{P}tier": "gpu_cuda"}, previous={"site": "basement", f"{P}tier": "gpu_cuda"})
    # "team" was never the fabric's: another controller's or an operator's.
    assert patch == {"site": None}


def test_a_node_as_it_should_be_needs_no_patch():
    assert label_patch({f"{P}tier": "cpu_ffmpeg"}, {f"{P}tier": "cpu_ffmpeg"}, previous={f"{P}tier": "cpu_ffmpeg"}) == {}


def test_the_patch_is_a_json_merge_patch_of_the_labels():
    assert merge_patch_body({"a": "1", "b": None}) == {"metadata": {"labels": {"a": "1", "b": None}}}


def test_node_labels_on_k3s_command_line_are_found_and_those_beating_the_drop_in_named():
    argv = ["/usr/local/bin/k3s", "agent", "--node-label", f"{P}tier=relay", f"--node-label={P}gpu=nvidia-rtx4070", "--server", "https://x:6443"]
    assert command_line_labels(argv) == [f"{P}tier=relay", f"{P}gpu=nvidia-rtx4070"]
    assert overridden(command_line_labels(argv), dropin_labels(DROPIN)) == [f"{P}tier=relay (drop-in: gpu_cuda)"]
    assert command_line_labels(["/usr/bin/containerd-shim", "--node-label", "x=y"]) == []
