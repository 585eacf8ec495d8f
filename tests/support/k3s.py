"""What k3s writes that the fabric reads: the kubeconfig template of
k3s-io/k3s pkg/daemons/control/deps (KubeConfig), as its agent fills it for
the kubelet (pkg/agent/config/config.go: <data-dir>/agent/kubelet.kubeconfig)."""

from __future__ import annotations

KUBECONFIG_TEMPLATE = """apiVersion: v1
clusters:
- cluster:
    server: {server}
    certificate-authority: {ca}
  name: local
contexts:
- context:
    cluster: local
    namespace: default
    user: user
  name: Default
current-context: Default
kind: Config
preferences: {{}}
users:
- name: user
  user:
    client-certificate: {cert}
    client-key: {key}
"""


def kubeconfig(server: str, ca: object, cert: object, key: object) -> str:
    return KUBECONFIG_TEMPLATE.format(server=server, ca=ca, cert=cert, key=key)


# The agent's own, with k3s's default data directory and its API load balancer.
KUBELET_KUBECONFIG = kubeconfig(
    "https://127.0.0.1:6444",
    "/var/lib/rancher/k3s/agent/server-ca.crt",
    "/var/lib/rancher/k3s/agent/client-kubelet.crt",
    "/var/lib/rancher/k3s/agent/client-kubelet.key",
)
