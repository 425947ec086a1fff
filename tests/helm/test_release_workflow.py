"""The release workflow (.github/workflows/release.yml): linted by actionlint, its shell by
shellcheck, and its tag rules run: the steps that decide what a run may tag or publish are executed
here under the environments GitHub gives a tag push and a manual run from a branch, with stand-ins
for helm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.tools import CHART, REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SHA = "0123456789abcdef0123456789abcdef01234567"
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def _workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def _step(job: str, name: str) -> dict[str, Any]:
    return next(s for s in _workflow()["jobs"][job]["steps"] if s.get("name") == name)


def _run_step(step: dict[str, Any], tmp_path: Path, ref_type: str, ref_name: str, expressions: dict[str, str],
              path_dirs: list[Path] = ()) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """A step's script as the runner executes it (bash -e), its ${{ }} expressions given values,
    with GitHub's variables for this ref; returns the process and what it wrote to GITHUB_OUTPUT."""
    output, summary = tmp_path / "output", tmp_path / "summary"
    output.write_text("")
    env = {"PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]]), "HOME": str(tmp_path),
           "GITHUB_REF_TYPE": ref_type, "GITHUB_REF_NAME": ref_name, "GITHUB_SHA": SHA,
           "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(summary), "RUNNER_TEMP": str(tmp_path),
           **_workflow()["env"]}
    for key, value in step.get("env", {}).items():
        env[key] = EXPRESSION.sub(lambda m: expressions[m.group(1)], str(value))
    script = EXPRESSION.sub(lambda m: expressions[m.group(1)], step["run"])
    done = subprocess.run(["bash", "-e", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return done, outputs


# -- linters ------------------------------------------------------------------------------------

def _actionlint(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(REPO / "scripts" / "actionlint.cjs"), *map(str, files)],
                          capture_output=True, text=True, timeout=120)


needs_actionlint = pytest.mark.skipif(
    shutil.which("node") is None or not (REPO / ".tools" / "actionlint" / "main.wasm").exists(),
    reason="actionlint (wasm) and node: scripts/install_tools.sh")


@needs_actionlint
def test_actionlint_finds_nothing_in_the_workflows() -> None:
    workflows = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))
    result = _actionlint(*workflows)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_actionlint
def test_actionlint_here_does_catch_mistakes(tmp_path: Path) -> None:
    """The linter is live: an untrusted expression in a script and an unknown input are found."""
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    steps:\n"
                   "      - run: echo \"${{ github.event.head_commit.message }}\"\n"
                   "      - uses: actions/checkout@v4\n        with: {fetch_depth: 1}\n")
    result = _actionlint(bad)
    assert result.returncode == 1 and "potentially untrusted" in result.stdout and '"fetch_depth"' in result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck (Debian): scripts/install_tools.sh")
def test_every_run_script_passes_shellcheck(tmp_path: Path) -> None:
    """actionlint's wasm build cannot run shellcheck itself; the scripts go through it here."""
    for job_name, job in _workflow()["jobs"].items():
        for step in job["steps"]:
            if "run" not in step:
                continue
            script = tmp_path / "step.sh"
            script.write_text("#!/usr/bin/env bash\nset -e\n" + EXPRESSION.sub("EXPR", step["run"]))
            result = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
            assert result.returncode == 0, f"{job_name} / {step.get('name')}: {result.stdout}"


# -- what a run may tag ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["", "-cuda", "-vllm"])
def test_a_release_tag_pushes_the_version_tags(tmp_path: Path, suffix: str) -> None:
    done, out = _run_step(_step("images", "Image tag (a version only from its tag)"), tmp_path, "tag", f"v{VERSION}",
                          {"matrix.suffix": suffix})
    assert done.returncode == 0, done.stderr
    assert out == {"tag": f"{VERSION}{suffix}", "release": "true"}


@pytest.mark.parametrize("branch", ["main", "feature/x", f"v{VERSION}"])  # a branch named like a tag is still a branch
def test_a_manual_run_from_a_branch_never_takes_a_version_tag(tmp_path: Path, branch: str) -> None:
    done, out = _run_step(_step("images", "Image tag (a version only from its tag)"), tmp_path, "branch", branch,
                          {"matrix.suffix": "-cuda"})
    assert done.returncode == 0, done.stderr
    assert out == {"tag": f"sha-{SHA[:12]}-cuda", "release": "false"}
    assert not out["tag"].startswith(VERSION)


def test_a_tag_that_is_not_the_version_fails_the_run(tmp_path: Path) -> None:
    done, out = _run_step(_step("images", "Image tag (a version only from its tag)"), tmp_path, "tag", "v99.0.0",
                          {"matrix.suffix": ""})
    assert done.returncode != 0 and "does not match" in done.stdout and "tag" not in out


def test_images_are_tagged_only_with_the_decided_tag_for_both_platforms() -> None:
    job = _workflow()["jobs"]["images"]
    names = [s.get("name", s.get("uses", "")) for s in job["steps"]]
    build = _step("images", "Build and push")
    assert build["with"]["tags"] == "${{ env.IMAGE }}:${{ steps.version.outputs.tag }}"  # nothing else (no latest)
    assert names.index("Image tag (a version only from its tag)") < names.index("Build and push")
    qemu = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/setup-qemu-action@"))
    assert "arm64" in qemu["with"]["platforms"]
    assert names.index(qemu["uses"]) < names.index("docker/setup-buildx-action@v3") < names.index("Build and push")
    for variant in job["strategy"]["matrix"]["include"]:
        assert set(variant["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}, variant["variant"]


# -- the chart ----------------------------------------------------------------------------------------

def _fake_tools(tmp_path: Path) -> Path:
    """helm and cosign that record their arguments (helm push prints a digest as the real one does),
    and python3 as this interpreter (with PyYAML)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("helm", "cosign"):
        script = bin_dir / tool
        script.write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >> {log}\n'
                          f'if [ "$1" = push ]; then echo "Pushed: ghcr.io/x/crescent:1"; echo "Digest: sha256:{"ab" * 32}"; fi\n'
                          'if [ "$1" = package ]; then cat >/dev/null </dev/null; fi\n')
        script.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    return bin_dir


def test_the_chart_job_runs_only_for_a_release_tag_after_the_images() -> None:
    chart = _workflow()["jobs"]["chart"]
    assert chart["needs"] == "images"
    condition = chart["if"]
    assert "github.ref_type == 'tag'" in condition and "&&" in condition and "||" not in condition
    assert chart["permissions"] == {"contents": "read", "packages": "write", "id-token": "write"}
    assert _workflow()["env"]["CHART_REPOSITORY"].startswith("oci://ghcr.io/")


def test_a_release_tag_packages_and_pushes_the_chart_as_an_oci_artifact(tmp_path: Path) -> None:
    bin_dir = _fake_tools(tmp_path)
    package, out = _run_step(_step("chart", "Package the chart (its version and appVersion are the release's)"),
                             tmp_path, "tag", f"v{VERSION}", {}, [bin_dir])
    assert package.returncode == 0, package.stdout + package.stderr
    assert out == {"archive": f"dist/crescent-{VERSION}.tgz", "version": VERSION}
    push, pushed = _run_step(_step("chart", "Push to GHCR as an OCI artifact"), tmp_path, "tag", f"v{VERSION}",
                             {"steps.package.outputs.archive": out["archive"], "secrets.GITHUB_TOKEN": "t",
                              "github.actor": "bot"}, [bin_dir])
    assert push.returncode == 0, push.stdout + push.stderr
    assert pushed == {"digest": f"sha256:{'ab' * 32}"}
    sign, _ = _run_step(_step("chart", "Sign the chart by digest"), tmp_path, "tag", f"v{VERSION}",
                        {"steps.push.outputs.digest": pushed["digest"], "secrets.GITHUB_TOKEN": "t", "github.actor": "bot",
                         "steps.package.outputs.version": VERSION}, [bin_dir])
    assert sign.returncode == 0, sign.stdout + sign.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert f"helm package helm/crescent --version {VERSION} --app-version {VERSION} --destination dist" in calls
    assert f"helm push dist/crescent-{VERSION}.tgz {_workflow()['env']['CHART_REPOSITORY']}" in calls
    assert f"cosign sign --yes ghcr.io/crescent-llm/charts/crescent@sha256:{'ab' * 32}" in calls
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == VERSION


@pytest.mark.parametrize(("ref_type", "ref_name"), [("branch", "main"), ("tag", "v99.0.0")])
def test_the_chart_is_never_packaged_for_another_ref(tmp_path: Path, ref_type: str, ref_name: str) -> None:
    bin_dir = _fake_tools(tmp_path)
    done, out = _run_step(_step("chart", "Package the chart (its version and appVersion are the release's)"),
                          tmp_path, ref_type, ref_name, {}, [bin_dir])
    assert done.returncode != 0 and "must agree" in done.stdout and not out
    assert not (tmp_path / "calls.log").exists()  # helm never ran
