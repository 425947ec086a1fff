"""Smaller promises: SLOs settable with --set, image digests, and the `helm test` pod, whose
script is run here against a stub gateway on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

from tests.helm.test_pod_security import restricted_violations
from tests.helm.tools import by_kind, helm_template, render

DIGEST = "sha256:" + "ab" * 32


def test_slos_can_be_set_with_set_as_with_set_json() -> None:
    """helm --set passes 0.05 as the string "0.05"; the chart must render what --set-json renders."""
    common = ["--set", "monitoring.prometheusRule.enabled=true", "--set", "decode.autoscaling.enabled=true",
              "--set", "decode.autoscaling.keda.enabled=true"]
    values = {"slo.tbtSeconds": "0.05", "slo.ttftSeconds": "7.5", "slo.objective": "0.995",
              "monitoring.prometheusRule.rejectionRatio": "0.02"}
    as_strings = helm_template(*common, *[a for k, v in values.items() for a in ("--set", f"{k}={v}")])
    as_numbers = helm_template(*common, *[a for k, v in values.items() for a in ("--set-json", f"{k}={v}")])
    assert as_strings.returncode == 0, as_strings.stderr
    docs = [d for d in yaml.safe_load_all(as_strings.stdout) if d]
    # Alike but for the internal TLS certificates, which every render makes anew.
    assert [d for d in docs if d["kind"] != "Secret"] == \
        [d for d in yaml.safe_load_all(as_numbers.stdout) if d and d["kind"] != "Secret"]
    scheduler = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])
    assert scheduler["slo"]["tbt_s"] == 0.05 and scheduler["slo"]["ttft_s"] == 7.5
    assert 'le="0.05"' in as_strings.stdout and 'le="7.5"' in as_strings.stdout
    # Off the histogram's buckets or out of range stays refused, however it is spelt.
    for flag in ("slo.tbtSeconds=0.06", "slo.ttftSeconds=2.5", "slo.objective=1.5", "slo.objective=abc"):
        result = helm_template("--set", flag)
        assert result.returncode != 0 and flag.split("=")[0].split(".")[1] in result.stderr, flag


def test_image_digest_pins_the_image() -> None:
    docs = render("--set", f"gateway.image.digest={DIGEST}", "--set", f"kvstore.image.digest={DIGEST}")
    gateway = by_kind(docs, "Deployment")["crescent-gateway"]["spec"]["template"]["spec"]
    assert gateway["containers"][0]["image"] == f"ghcr.io/crescent-llm/crescent@{DIGEST}"
    kvstore = by_kind(docs, "DaemonSet")["crescent-kvstore"]["spec"]["template"]["spec"]
    assert {c["image"] for c in kvstore["containers"] + kvstore["initContainers"]} == {f"ghcr.io/crescent-llm/crescent@{DIGEST}"}
    scheduler = by_kind(docs, "Deployment")["crescent-scheduler"]["spec"]["template"]["spec"]
    assert scheduler["containers"][0]["image"] == "ghcr.io/crescent-llm/crescent:0.1.0"
    bad = helm_template("--set", "gateway.image.digest=sha256:xyz")
    assert bad.returncode != 0 and "digest" in bad.stderr


# The stub gateway: what it answers is set per test.
class _Gateway(BaseHTTPRequestHandler):
    models = ["smollm2-135m-instruct"]
    key = "crs-test"
    reply = "Hello!"

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.key}"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        elif not self._authorized():
            self._send(401, {"error": {"message": "missing key"}})
        else:
            self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if not self._authorized():
            self._send(401, {})
            return
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": self.reply}}],
                         "usage": {"completion_tokens": len(self.reply.split())}})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    _Gateway.models, _Gateway.reply = ["smollm2-135m-instruct"], "Hello!"


def _run_test_pod(url: str, *args: str, key: str = "") -> subprocess.CompletedProcess[str]:
    """The rendered test pod's command and environment, run here against `url`."""
    (pod,) = [d for d in render(*args) if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    env.update(CRESCENT_TEST_URL=url, PATH=os.environ["PATH"])
    if "CRESCENT_TEST_API_KEY" in env:
        assert container["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "crescent-test-key", "key": "api-key"}
        env["CRESCENT_TEST_API_KEY"] = key
    command = [sys.executable if container["command"][0] == "python" else container["command"][0], *container["command"][1:]]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


KEYED = ["--set", "helmTest.apiKeySecret=crescent-test-key"]


@pytest.mark.slow
def test_helm_test_pod_passes_against_a_serving_gateway(gateway: str) -> None:
    result = _run_test_pod(gateway, *KEYED, key="crs-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lists smollm2-135m-instruct" in result.stdout and "has an answer" in result.stdout


@pytest.mark.slow
def test_helm_test_pod_fails_when_the_model_is_missing_or_silent(gateway: str) -> None:
    _Gateway.models = ["another-model"]
    result = _run_test_pod(gateway, *KEYED, key="crs-test")
    assert result.returncode == 1 and "FAIL GET /v1/models lists smollm2-135m-instruct" in result.stdout
    _Gateway.models, _Gateway.reply = ["smollm2-135m-instruct"], ""
    result = _run_test_pod(gateway, *KEYED, key="crs-test")
    assert result.returncode == 1 and "FAIL the chat completion has an answer" in result.stdout


@pytest.mark.slow
def test_helm_test_pod_without_a_key_checks_that_auth_refuses(gateway: str) -> None:
    result = _run_test_pod(gateway)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused with 401" in result.stdout and "chat" not in result.stdout.split("refused")[0]
    # A wrong key is a failure, not a pass.
    assert _run_test_pod(gateway, *KEYED, key="crs-wrong").returncode == 1


def test_helm_test_pod_is_restricted_and_can_be_left_out() -> None:
    (pod,) = [d for d in render() if d["kind"] == "Pod"]
    assert restricted_violations(pod["spec"]) == []
    assert [d for d in render("--set", "helmTest.enabled=false") if d["kind"] == "Pod"] == []
