"""Regenerate the Python stubs for the .proto files in this folder.

Run ``python -m crescent.protos.generate`` (or ``make protos``). The stubs are committed;
``tests/test_protos.py`` fails when they are stale. protoc sees the files under the virtual
path ``crescent/protos/`` so generated imports read ``from crescent.protos import ...``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL_PREFIX = "crescent/protos"


def generate(out_dir: Path) -> list[Path]:
    """Write the generated stubs for every .proto into ``out_dir``; return their paths."""
    from grpc_tools import protoc  # dev-only dependency: imported where it is needed
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"--proto_path={VIRTUAL_PREFIX}={PROTO_DIR}",
            f"--proto_path={well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[f"{VIRTUAL_PREFIX}/{p.name}" for p in protos],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for generated in sorted((Path(tmp) / VIRTUAL_PREFIX).iterdir()):
            target = out_dir / generated.name
            shutil.copyfile(generated, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
