"""reconciler.adapters.k3s_node against a recording stand-in of the Kubernetes API.

k3s cannot run here; what the adapter must get right is its side of the
contract, which the stand-in checks as the API server would: TLS with the
server CA from the kubelet's kubeconfig (in k3s's own template), the kubelet's
client certificate required, `GET /api/v1/nodes/<name>` answered with a Node
(tests/fixtures/k3s/node-qfox-1.json), and `PATCH` accepted only as
`application/merge-patch+json` (RFC 7386: null deletes a label). Every request
is recorded with the client certificate's common name.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reconciler.adapters.k3s_node import KubeletNodeLabels
from reconciler.ports import NodeLabelsUnavailable
from tests.conftest import REPO
from tests.support.harness.etcd import TestPki
from tests.support.k3s import kubeconfig as k3s_kubeconfig

pytestmark = pytest.mark.integration

NODE = json.loads((REPO / "tests" / "fixtures" / "k3s" / "node-qfox-1.json").read_text())
P = "topology.researchstack.io/"


class ApiStandIn(ThreadingHTTPServer):
    def __init__(self, pki: TestPki) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.node = json.loads(json.dumps(NODE))
        self.requests: list[dict[str, object]] = []
        self.forbid: str | None = None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        context.load_verify_locations(str(pki.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
        self.socket = context.wrap_socket(self.socket, server_side=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: ApiStandIn

    def log_message(self, *args: object) -> None:
        pass

    def _record(self, body: bytes | None) -> None:
        peer = self.connection.getpeercert()  # type: ignore[attr-defined]
        subject = dict(item[0] for item in peer["subject"]) if peer else {}
        self.server.requests.append(
            {"method": self.command, "path": self.path, "type": self.headers.get("Content-Type"), "body": body, "cn": subject.get("commonName")}
        )

    def _answer(self, status: int, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._record(None)
        if self.path != f"/api/v1/nodes/{self.server.node['metadata']['name']}":
            self._answer(404, {"kind": "Status", "status": "Failure", "message": f"nodes {self.path!r} not found", "code": 404})
            return
        self._answer(200, self.server.node)

    def do_PATCH(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._record(body)
        if self.server.forbid:
            self._answer(403, {"kind": "Status", "status": "Failure", "message": self.server.forbid, "reason": "Forbidden", "code": 403})
            return
        if self.headers.get("Content-Type") != "application/merge-patch+json":
            self._answer(415, {"kind": "Status", "status": "Failure", "message": "unsupported media type", "code": 415})
            return
        labels = self.server.node["metadata"]["labels"]
        for key, value in json.loads(body)["metadata"]["labels"].items():
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
        self._answer(200, self.server.node)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiStandIn, TestPki]]:
    pki = TestPki(tmp_path / "pki")
    server = ApiStandIn(pki)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, pki
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def kubelet(tmp_path: Path, server: ApiStandIn, pki: TestPki, common_name: str = "system:node:qfox-1") -> KubeletNodeLabels:
    cert, key = pki.client(common_name)
    kubeconfig = tmp_path / "kubelet.kubeconfig"
    kubeconfig.write_text(k3s_kubeconfig(server.url, pki.ca_file, cert, key))
    return KubeletNodeLabels(str(kubeconfig))


def test_the_nodes_labels_are_read_as_its_kubelet(api, tmp_path):
    server, pki = api
    labels = kubelet(tmp_path, server, pki).labels("qfox-1")
    assert labels[f"{P}storage"] == "nvme" and labels["kubernetes.io/hostname"] == "qfox-1"
    (request,) = server.requests
    assert (request["method"], request["path"], request["cn"]) == ("GET", "/api/v1/nodes/qfox-1", "system:node:qfox-1")


def test_one_merge_patch_sets_and_removes_labels_and_touches_no_other(api, tmp_path):
    server, pki = api
    node = kubelet(tmp_path, server, pki)
    node.patch("qfox-1", {f"{P}storage": None, f"{P}tier": "gpu_vaapi"})
    request = server.requests[-1]
    assert (request["method"], request["type"]) == ("PATCH", "application/merge-patch+json")
    assert json.loads(request["body"]) == {"metadata": {"labels": {f"{P}storage": None, f"{P}tier": "gpu_vaapi"}}}  # type: ignore[arg-type]
    labels = node.labels("qfox-1")
    assert f"{P}storage" not in labels and labels[f"{P}tier"] == "gpu_vaapi" and labels["kubernetes.io/os"] == "linux"


def test_a_refusal_of_the_api_is_unavailable_with_its_status_message(api, tmp_path):
    server, pki = api
    server.forbid = 'nodes "qfox-1" is forbidden: is not allowed to modify labels: node-restriction.kubernetes.io/x'
    with pytest.raises(NodeLabelsUnavailable, match='HTTP 403 nodes "qfox-1" is forbidden'):
        kubelet(tmp_path, server, pki).patch("qfox-1", {"node-restriction.kubernetes.io/x": "y"})


def test_a_server_another_ca_signed_is_not_spoken_to(api, tmp_path):
    server, pki = api
    other = TestPki(tmp_path / "other")
    cert, key = pki.client("system:node:qfox-1")
    kubeconfig = tmp_path / "kubelet.kubeconfig"
    kubeconfig.write_text(k3s_kubeconfig(server.url, other.ca_file, cert, key))
    with pytest.raises(NodeLabelsUnavailable, match="SSLCertVerificationError|SSLError"):
        KubeletNodeLabels(str(kubeconfig)).labels("qfox-1")
    assert server.requests == []


def test_an_unreadable_kubeconfig_is_named_and_its_content_never_shown(tmp_path):
    kubeconfig = tmp_path / "kubelet.kubeconfig"
    kubeconfig.write_text("users:\n- user:\n    token: s3cr3t-token-value\n")
    with pytest.raises(NodeLabelsUnavailable) as raised:
        KubeletNodeLabels(str(kubeconfig)).labels("qfox-1")
    assert str(kubeconfig) in str(raised.value) and "s3cr3t" not in str(raised.value)
    with pytest.raises(NodeLabelsUnavailable, match="No such file"):
        KubeletNodeLabels(str(tmp_path / "absent")).labels("qfox-1")


def test_the_k3s_process_command_line_is_found_in_proc(tmp_path):
    proc = tmp_path / "proc"
    for pid, argv in ((12, ["/usr/bin/containerd"]), (40, ["/usr/local/bin/k3s", "agent", "--node-label", "a=b"]), (7, [])):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + (b"\0" if argv else b""))
    (proc / "self").mkdir()
    assert KubeletNodeLabels(proc=str(proc)).command_line() == ["/usr/local/bin/k3s", "agent", "--node-label", "a=b"]


def test_the_nodes_ready_condition_is_read_as_its_kubelet(api, tmp_path):
    server, pki = api
    node = kubelet(tmp_path, server, pki)
    assert node.ready("qfox-1") is True
    server.node["status"]["conditions"][0]["status"] = "Unknown"  # the node controller's word for a silent kubelet
    assert node.ready("qfox-1") is False
