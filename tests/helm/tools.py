"""Finding the external tools the chart tests drive, and rendering the chart with them.

scripts/install_tools.sh puts helm and kubectl in .tools/bin, kubernetes-validate and
grafana-foundation-sdk in the venv, and promtool/prometheus on PATH (Debian package).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "crescent"
EXAMPLES = REPO / "helm" / "examples"
RELEASE = "crescent"
NAMESPACE = "serving"
INSTALL_HINT = "run scripts/install_tools.sh"


def tool(name: str) -> str:
    """Path of a tool from .tools/bin, the venv, or PATH; skip the test when it is missing."""
    for candidate in (REPO / ".tools" / "bin" / name, Path(sys.executable).parent / name):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({INSTALL_HINT})")
    return found


def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)


# Renders are memoised for the session, keyed by helm's arguments and the values files' bytes: the
# chart tests render the same values many times (the default alone ~14 times), and each `helm
# template` is a subprocess of ~0.3-1 s on 2 busy cores. Not memoised: renders that read a cluster
# (`--kubeconfig`, `--dry-run=server`: the answer depends on its state) and those asked `fresh`
# (the self-signed CA is new in every render, which a test may check).
_RENDERS: dict[tuple, subprocess.CompletedProcess[str]] = {}
_PARSED: dict[tuple, list[dict[str, Any]]] = {}
_READS_A_CLUSTER = ("--kubeconfig", "--dry-run=server")


def _render_key(cmd: list[str], values: list[Path] | tuple[Path, ...]) -> tuple:
    contents = tuple(hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in values)
    return (*cmd, contents)


def _helm(cmd: list[str], values: list[Path] | tuple[Path, ...], fresh: bool) -> subprocess.CompletedProcess[str]:
    if fresh or any(arg.startswith(_READS_A_CLUSTER) for arg in cmd):
        return run(cmd)
    key = _render_key(cmd, values)
    if key not in _RENDERS:
        _RENDERS[key] = run(cmd)
    cached = _RENDERS[key]  # a copy: a test may not change what the next one reads
    return subprocess.CompletedProcess(cached.args, cached.returncode, cached.stdout, cached.stderr)


def helm_template(*args: str, values: list[Path] = (), show_only: str | None = None,
                  fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart (memoised per session unless ``fresh``: see above)."""
    cmd = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values:
        cmd += ["-f", str(path)]
    if show_only:
        cmd += ["--show-only", show_only]
    return _helm(cmd + list(args), values, fresh)


def render(*args: str, values: list[Path] = (), fresh: bool = False) -> list[dict[str, Any]]:
    """Rendered manifests as dicts (the test's own copy); fails the test with helm's message if
    rendering fails. ``fresh``: a new render (a new self-signed CA), not the session's memo."""
    result = helm_template(*args, values=values, fresh=fresh)
    assert result.returncode == 0, result.stderr
    if fresh:
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    key = (result.stdout,)
    if key not in _PARSED:
        _PARSED[key] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return copy.deepcopy(_PARSED[key])  # tests edit what they get (use_rendered_tls)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def rules_file(tmp_path: Path, *args: str) -> Path:
    """The PrometheusRule's groups as a plain Prometheus rules file (what promtool reads)."""
    docs = render("--set", "monitoring.prometheusRule.enabled=true", *args)
    (rule,) = by_kind(docs, "PrometheusRule").values()
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False, width=10**6))
    return path


def notes(*args: str, values: list[Path] = ()) -> str:
    """NOTES.txt as `helm install` prints it (a client-side dry run: no cluster needed; memoised)."""
    cmd = [tool("helm"), "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    for path in values:
        cmd += ["-f", str(path)]
    result = _helm(cmd + list(args), values, fresh=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def rendered_tls(docs: list[dict[str, Any]], secret: str, directory: Path, server_name: str = "") -> dict[str, str]:
    """A rendered TLS Secret (ca.crt, tls.crt, tls.key) written to ``directory`` as a pod would
    see it mounted (the key 0600 here); returns the ``tls`` settings pointing at the files."""
    data = by_kind(docs, "Secret")[secret]["data"]
    directory.mkdir(parents=True, exist_ok=True)
    for key in ("ca.crt", "tls.crt", "tls.key"):
        path = directory / key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(data[key]))
    settings = {"ca": str(directory / "ca.crt"), "cert": str(directory / "tls.crt"), "key": str(directory / "tls.key")}
    return {**settings, "server_name": server_name} if server_name else settings


def use_rendered_tls(config: dict[str, Any], docs: list[dict[str, Any]], secret: str, directory: Path) -> dict[str, Any]:
    """A rendered component ``config`` whose ``tls`` section (as rendered: files under the pod's
    mount) points at ``secret``'s files written to ``directory`` instead; the rest is untouched."""
    files = rendered_tls(docs, secret, directory)
    tls = config["tls"]
    for key in ("ca", "cert", "key"):  # /etc/crescent-tls/ca.crt -> <directory>/ca.crt
        assert Path(files[key]).name == Path(tls[key]).name, (key, tls[key])
        tls[key] = files[key]
    return config


def tls_channel(docs: list[dict[str, Any]], secret: str, address: str, directory: Path, server_name: str) -> grpc.Channel:
    """A gRPC channel to ``address`` presenting the rendered ``secret``'s certificate."""
    files = {k: Path(v).read_bytes() for k, v in rendered_tls(docs, secret, directory).items()}
    credentials = grpc.ssl_channel_credentials(files["ca"], files["key"], files["cert"])
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", server_name)])
