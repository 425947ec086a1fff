"""The Dockerfiles and the chart's default images agree (no Docker engine here: static checks)."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from tests.helm.tools import CHART, REPO

DOCKERFILES = {"cpu": REPO / "deploy" / "Dockerfile", "cuda": REPO / "deploy" / "Dockerfile.cuda"}


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
    bases = [arg.split()[0] for op, arg in steps if op == "FROM"]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    for base in bases:
        image = args.get(base.strip("${}"), base) if base.startswith("$") else base
        assert re.search(r":\d+\.\d+", image), f"unpinned base image {image}"
    assert "torch==2.13.0" in text
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
    for component in ("prefill", "decode"):
        assert values[component]["image"]["tag"] == f"{version}-cuda"
    for variant, path in DOCKERFILES.items():
        tag = version if variant == "cpu" else f"{version}-cuda"
        assert f"{values['gateway']['image']['repository']}:{tag}" in path.read_text()


WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def test_release_workflow_builds_pushes_signs_and_attaches_sboms() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["images"]
    variants = {v["variant"]: v for v in job["strategy"]["matrix"]["include"]}
    assert (REPO / variants["cpu"]["dockerfile"]) == DOCKERFILES["cpu"]
    assert (REPO / variants["cuda"]["dockerfile"]) == DOCKERFILES["cuda"]
    assert set(variants["cpu"]["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert variants["cuda"]["platforms"] == "linux/amd64"
    # The tags the chart's default images name: <version> and <version>-cuda at its repository.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert workflow["env"]["IMAGE"] == values["gateway"]["image"]["repository"]
    assert (variants["cpu"]["suffix"], variants["cuda"]["suffix"]) == ("", "-cuda")
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


def test_release_tag_must_match_the_version() -> None:
    text = WORKFLOW.read_text()
    assert 'tomllib.load(open("pyproject.toml", "rb"))["project"]["version"]' in text
    assert '"$GITHUB_REF_NAME" != "v$version"' in text
