"""The Dockerfiles and the chart's default images agree (no Docker engine here: static checks),
and the vLLM image's dependency step keeps vLLM's packages (deploy/vllm_image_deps.py, run on
fake inputs)."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tests.helm.tools import CHART, REPO

DOCKERFILES = {"cpu": REPO / "deploy" / "Dockerfile", "cuda": REPO / "deploy" / "Dockerfile.cuda",
               "vllm": REPO / "deploy" / "Dockerfile.vllm"}
SUFFIX = {"cpu": "", "cuda": "-cuda", "vllm": "-vllm"}
VLLM_BASE = "vllm/vllm-openai:v0.33.0"  # vLLM 0.33.0's official image: the CUDA build PyPI's vllm==0.33.0 is


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_entrypoint_is_crescent_serve(variant: str) -> None:
    steps = _instructions(DOCKERFILES[variant].read_text())
    entrypoints = [json.loads(arg) for op, arg in steps if op == "ENTRYPOINT"]
    assert entrypoints[-1] == ["crescent", "serve"]
    users = [arg for op, arg in steps if op == "USER"]
    # The chart runs pods as uid 10001 with runAsNonRoot; the image must agree.
    assert users[-1].split(":")[0] == str(yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"])


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_base_images_and_torch_are_pinned(variant: str) -> None:
    text = DOCKERFILES[variant].read_text()
    steps = _instructions(text)
    bases = [next(w for w in arg.split() if not w.startswith("--")) for op, arg in steps if op == "FROM"]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    images = [args.get(base.strip("${}"), base) if base.startswith("$") else base for base in bases]
    for image in images:
        assert re.search(r":v?\d+\.\d+", image), f"unpinned base image {image}"
    if variant == "vllm":
        # vLLM's image brings its own torch; installing Crescent's pin would replace it.
        assert images[-1] == VLLM_BASE and "torch==" not in text
    else:
        assert "torch==2.13.0" in text
    if variant in ("vllm", "cuda"):
        # Triton compiles its launchers at run time, the first time a kernel launches.
        installs = " ".join(arg for op, arg in steps if op == "RUN" and "apt-get install" in arg)
        assert "gcc" in installs.split() and "libc6-dev" in installs.split()
        assert "Python.h" in text  # and the build fails without Python's headers
        # The pure-Python wheel is built on the builder's platform, not under QEMU.
        assert any(op == "FROM" and "--platform=$BUILDPLATFORM" in arg and " AS build" in arg for op, arg in steps)
    # Every folder the image builds from exists.
    for op, arg in steps:
        if op == "COPY" and "--from" not in arg:
            for source in arg.split()[:-1]:
                if source != "README.md":  # required by pyproject; written with the top-level docs
                    assert (REPO / source).exists(), source


def test_default_images_are_the_release_the_dockerfiles_build() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for component in ("gateway", "scheduler", "kvstore"):
        assert values[component]["image"]["tag"] == version
    for component in ("prefill", "decode", "aggregated"):
        assert values[component]["image"]["tag"] == f"{version}-cuda"
    assert values["aggregated"]["image"]["vllm"]["tag"] == f"{version}-vllm"
    assert values["aggregated"]["image"]["vllm"]["repository"] == values["gateway"]["image"]["repository"]
    for variant, path in DOCKERFILES.items():
        assert f"{values['gateway']['image']['repository']}:{version}{SUFFIX[variant]}" in path.read_text()


WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def test_release_workflow_builds_pushes_signs_and_attaches_sboms() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["images"]
    variants = {v["variant"]: v for v in job["strategy"]["matrix"]["include"]}
    for variant, path in DOCKERFILES.items():
        assert (REPO / variants[variant]["dockerfile"]) == path
        assert variants[variant]["suffix"] == SUFFIX[variant]
    # Every image on both: x86 HGX servers and GB200/GB300/GH200 (Grace, arm64) trays.
    for variant in DOCKERFILES:
        assert set(variants[variant]["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}, variant
    # The tags the chart's default images name: <version> and <version>-cuda at its repository.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert workflow["env"]["IMAGE"] == values["gateway"]["image"]["repository"]
    assert job["permissions"] == {"contents": "read", "packages": "write", "id-token": "write"}
    steps = {s.get("name", s.get("uses", "")): s for s in job["steps"]}
    build = steps["Build and push"]
    assert build["uses"].startswith("docker/build-push-action@")
    assert build["with"]["push"] is True and build["with"]["sbom"] is True
    assert build["with"]["platforms"] == "${{ matrix.platforms }}"
    # Signed and attested by digest, never by a tag that could move.
    for name in ("Sign by digest", "SBOM as a signed attestation"):
        assert "$IMAGE@$DIGEST" in steps[name]["run"]
        assert steps[name]["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert "cosign sign --yes" in steps["Sign by digest"]["run"]
    assert "cosign attest --yes --type spdxjson" in steps["SBOM as a signed attestation"]["run"]
    # Every action is pinned to a release.
    for step in job["steps"]:
        if "uses" in step:
            assert re.search(r"@v\d+", step["uses"]), step["uses"]


def test_the_vllm_image_is_built_signed_and_pinned_in_the_summary_as_aggregated_image_vllm() -> None:
    text = WORKFLOW.read_text()
    job = yaml.safe_load(text)["jobs"]["images"]
    steps = {s.get("name", s.get("uses", "")): s for s in job["steps"]}
    summary = steps["Digest for the chart"]["run"]
    assert "aggregated: {image: {vllm:" in summary
    # vLLM's multi-arch image is large: the runner frees disk before pulling it.
    assert steps["Free disk space for vLLM's image"]["if"] == "matrix.variant == 'vllm'"
    ignore = (REPO / "deploy" / "Dockerfile.vllm.dockerignore").read_text().split()
    assert "!deploy/vllm_image_deps.py" in ignore


def _deps_module():
    spec = importlib.util.spec_from_file_location("vllm_image_deps", REPO / "deploy" / "vllm_image_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_image_deps_keep_vllms_packages_and_install_only_the_missing(tmp_path: Path) -> None:
    deps = _deps_module()
    wheel = tmp_path / "crescent-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("crescent-0.1.0.dist-info/METADATA", "\n".join([
            "Metadata-Version: 2.1", "Name: crescent", "Version: 0.1.0",
            "Requires-Dist: torch==2.13.0", "Requires-Dist: llguidance==1.9.1", "Requires-Dist: fastapi>=0.115",
            "Requires-Dist: isal==1.9.1", "Requires-Dist: redis[hiredis]<9,>=5",
            'Requires-Dist: pytest>=8; extra == "test"', ""]))
    requirements = deps.wheel_requirements(wheel)
    assert [r.name for r in requirements] == ["torch", "llguidance", "fastapi", "isal", "redis"]  # no extras
    # vLLM's image has its own torch, llguidance and fastapi: those serve Crescent as they are.
    installed = {"torch": "2.11.0", "llguidance": "1.3.0", "fastapi": "0.121.0", "numpy": "2.2.6"}
    served, missing = deps.split_requirements(requirements, installed)
    assert {r.name: v for r, v in served} == {"torch": "2.11.0", "llguidance": "1.3.0", "fastapi": "0.121.0"}
    assert [str(r) for r in missing] == ["isal==1.9.1", "redis[hiredis]<9,>=5"]


def test_vllm_image_deps_report_vllms_broken_requirements_but_not_crescents_own() -> None:
    deps = _deps_module()
    installed = {"torch": "2.11.0", "vllm": "0.33.0", "llguidance": "1.3.0", "crescent": "0.1.0"}
    dists = [("vllm", "0.33.0", ["torch==2.11.0", "llguidance<1.4,>=1.3", 'pytest; extra == "test"']),
             ("crescent", "0.1.0", ["torch==2.13.0", "llguidance==1.9.1"])]
    assert deps.unsatisfied(dists, installed) == []  # Crescent's own pins are vLLM's to serve
    moved = {**installed, "llguidance": "1.9.1"}
    assert deps.unsatisfied(dists, moved) == ["vllm 0.33.0 requires llguidance<1.4,>=1.3, but 1.9.1 is installed"]
    assert deps.unsatisfied([("vllm", "0.33.0", ["xgrammar==0.2.8"])], installed) == [
        "vllm 0.33.0 requires xgrammar==0.2.8, which is not installed"]
    assert Requirement("redis[hiredis]<9,>=5").name == "redis"
