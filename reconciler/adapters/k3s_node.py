"""reconciler.ports.NodeLabels over the Kubernetes API, as this node's kubelet.

k3s's agent sets its Node's labels with the kubelet's kubeconfig
(<data-dir>/agent/kubelet.kubeconfig: the agent's API load balancer, the
server CA, the kubelet's client certificate and key, as files); so does this.
The NodeRestriction admission plugin lets a kubelet change its own Node's
labels outside the kubernetes.io and k8s.io prefixes, which is all the fabric
sets. Standard library only: one GET and one merge PATCH per changed drop-in.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit

from reconciler.core.render.k3s_node import KUBELET_KUBECONFIG, KubeconfigError, KubeletAccess, merge_patch_body, parse_kubeconfig
from reconciler.ports import NodeLabelsUnavailable

TIMEOUT_S = 5.0


class KubeletNodeLabels:
    def __init__(self, kubeconfig: str = KUBELET_KUBECONFIG, proc: str = "/proc", timeout_s: float = TIMEOUT_S) -> None:
        self.kubeconfig = kubeconfig
        self.proc = proc
        self.timeout_s = timeout_s

    def _access(self) -> KubeletAccess:
        try:
            text = Path(self.kubeconfig).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise NodeLabelsUnavailable(f"{self.kubeconfig}: {exc.strerror or exc}") from None
        try:
            return parse_kubeconfig(text)
        except KubeconfigError as exc:
            raise NodeLabelsUnavailable(f"{self.kubeconfig}: {exc}") from None

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> dict[str, object]:
        access = self._access()
        url = urlsplit(access.server)
        try:
            context = ssl.create_default_context(cafile=access.certificate_authority)
            context.load_cert_chain(access.client_certificate, access.client_key)
        except (OSError, ssl.SSLError) as exc:
            # The paths are k3s's; the message says which failed, not what is in it.
            raise NodeLabelsUnavailable(f"the kubelet's credentials ({access.client_certificate}): {exc.__class__.__name__}") from None
        connection = http.client.HTTPSConnection(url.hostname or "", url.port or 443, context=context, timeout=self.timeout_s)
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read(1024 * 1024)
        except (OSError, http.client.HTTPException) as exc:
            raise NodeLabelsUnavailable(f"{access.server}: {exc.__class__.__name__}: {exc}") from None
        finally:
            connection.close()
        if response.status != 200:
            raise NodeLabelsUnavailable(f"{method} {path}: HTTP {response.status} {_status_message(data)}")
        try:
            value = json.loads(data)
        except ValueError:
            raise NodeLabelsUnavailable(f"{method} {path}: the answer is not JSON") from None
        if not isinstance(value, dict):
            raise NodeLabelsUnavailable(f"{method} {path}: the answer is not an object")
        return value

    def labels(self, node: str) -> dict[str, str]:
        answer = self._request("GET", f"/api/v1/nodes/{quote(node, safe='')}")
        metadata = answer.get("metadata")
        labels = metadata.get("labels") if isinstance(metadata, dict) else None
        if labels is None:
            return {}
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise NodeLabelsUnavailable(f"node {node}: its labels are not a map of strings")
        return dict(labels)

    def ready(self, node: str) -> bool:
        answer = self._request("GET", f"/api/v1/nodes/{quote(node, safe='')}")
        status = answer.get("status")
        conditions = status.get("conditions") if isinstance(status, dict) else None
        return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions or ())

    def patch(self, node: str, changes: Mapping[str, str | None]) -> None:
        body = json.dumps(merge_patch_body(changes), sort_keys=True).encode()
        self._request("PATCH", f"/api/v1/nodes/{quote(node, safe='')}", body, "application/merge-patch+json")

    def command_line(self) -> list[str]:
        """The first process whose program is k3s (its agent or server)."""
        try:
            pids = sorted(int(p) for p in os.listdir(self.proc) if p.isdigit())
        except OSError:
            return []
        for pid in pids:
            try:
                raw = Path(f"{self.proc}/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
            if argv and argv[0].rsplit("/", 1)[-1] == "k3s" and len(argv) > 1 and argv[1] in ("agent", "server"):
                return argv
        return []


def _status_message(data: bytes) -> str:
    """The API's own Status message, short."""
    try:
        status = json.loads(data)
    except ValueError:
        return ""
    message = status.get("message") if isinstance(status, dict) else None
    return str(message)[:200] if message else ""
