"""The CPU image built from deploy/Dockerfile with buildah (vfs storage, no daemon) serves: `crescent
up` inside it answers /health, /v1/models and a chat completion (the `helm test` pod's script).

Where the sandbox cannot do a step, the test skips with the exact reason. Here (docs/operators.md,
"Images"): the base image's registry and PyTorch's CPU index are unreachable, so the build uses
the stand-in base from scripts/image_standin_base.sh and a local CPU torch wheel; the machine's
CA bundle is mounted into the build because its TLS traffic is re-signed by a local proxy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helm.tools import CHART, REPO

pytestmark = [pytest.mark.buildah, pytest.mark.slow]

DOCKERFILE = REPO / "deploy" / "Dockerfile"
IMAGE = "localhost/crescent:buildah-test"
STANDIN_BASE = "localhost/crescent-base:bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_WHEELS = Path(os.environ.get("CRESCENT_TORCH_WHEELS", "/opt/wheels"))


def _buildah(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STORAGE_DRIVER": "vfs"}
    return subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, name
    return match.group(1)


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=10).close()
        return True
    except OSError:
        return False


def _build_args() -> list[str]:
    """Build arguments for this machine, or a skip naming what it lacks."""
    args: list[str] = []
    base = _dockerfile_arg("PYTHON_IMAGE")
    pulled = _buildah("pull", base)
    if pulled.returncode != 0:
        if _buildah("inspect", "--type", "image", STANDIN_BASE).returncode != 0:
            pytest.skip(f"cannot pull the base image {base} ({_last_line(pulled.stderr)}) and there is no stand-in "
                        f"{STANDIN_BASE} (scripts/image_standin_base.sh makes one)")
        args += ["--build-arg", f"PYTHON_IMAGE={STANDIN_BASE}"]
    index = _dockerfile_arg("TORCH_INDEX_URL")
    if not _reachable(index + "/"):
        wheels = sorted(TORCH_WHEELS.glob("torch-2.13.0+cpu-*.whl"))
        if not wheels:
            pytest.skip(f"PyTorch's CPU index {index} is unreachable and {TORCH_WHEELS} holds no torch-2.13.0+cpu wheel "
                        "(set CRESCENT_TORCH_WHEELS)")
        args += ["--build-arg", "TORCH_INDEX_URL=", "--build-arg", "TORCH_FIND_LINKS=/host-wheels",
                 "-v", f"{TORCH_WHEELS}:/host-wheels:ro"]
    if HOST_CA.exists():  # trust what this machine trusts (a TLS-intercepting proxy, if any)
        args += ["-v", f"{HOST_CA}:/etc/ssl/certs/ca-certificates.crt:ro"]
    return args


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    if os.environ.get("CRESCENT_IMAGE_BUILD") != "1":
        pytest.skip("set CRESCENT_IMAGE_BUILD=1 to build and run the image (3.5 to 7 minutes and a few GB of disk on 2 cores)")
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (apt-get install buildah runc)")
    if os.geteuid() != 0:
        pytest.skip("buildah with vfs storage runs as root here (no rootless setup: no subuid ranges)")
    probe = _buildah("from", "scratch")
    if probe.returncode != 0:
        pytest.skip(f"buildah cannot create a container here: {_last_line(probe.stderr)}")
    _buildah("rm", probe.stdout.strip())
    build = _buildah("bud", "--network", "host", "--layers=false", "--ignorefile", str(DOCKERFILE) + ".dockerignore",
                     "-f", str(DOCKERFILE), *_build_args(), "-t", IMAGE, str(REPO), timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    yield IMAGE
    _buildah("rmi", IMAGE)


# Inside the container, on its own loopback (network none): start `crescent up`, wait until it
# says every service is ready (or dies), run the chart's `helm test` script, stop up, show its log's tail.
SERVE_AND_CHECK = """
crescent up --port 8000 --aggregated 1 --kvstore-gb 0.5 > /tmp/up.log 2>&1 &
up=$!
for i in $(seq 600); do
  kill -0 $up 2>/dev/null || { echo "crescent up exited"; tail -30 /tmp/up.log; exit 3; }
  grep -q "Crescent is up" /tmp/up.log && break
  sleep 1
done
CRESCENT_TEST_URL=http://127.0.0.1:8000 CRESCENT_TEST_MODEL=smollm2-135m-instruct CRESCENT_TEST_CHAT=1 \\
  CRESCENT_TEST_AUTH=0 python /check/helm_test.py
rc=$?
[ $rc -eq 0 ] || tail -40 /tmp/up.log
kill -TERM $up; wait $up
id -u
exit $rc
"""


def test_cpu_image_runs_crescent_up_and_answers_a_chat(image: str) -> None:
    created = _buildah("from", image)
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    try:
        result = _buildah("run", "--network", "none", "-v", f"{CHART / 'files'}:/check:ro", container, "--",
                          "sh", "-c", SERVE_AND_CHECK, timeout=900)
    finally:
        _buildah("rm", container)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "ok   GET /v1/models lists smollm2-135m-instruct" in output
    assert "ok   the chat completion has an answer" in output
    assert "10001" in output.splitlines()  # it ran as the chart's non-root user
