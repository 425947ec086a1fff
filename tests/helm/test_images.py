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
