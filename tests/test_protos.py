"""The committed gRPC stubs must be what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from crescent.protos import generate


def test_generated_stubs_are_up_to_date(tmp_path: Path):
    fresh = generate.generate(tmp_path)
    assert fresh, "no stubs generated"
    stale = [p.name for p in fresh if (generate.PROTO_DIR / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale stubs (run `make protos`): {stale}"
    committed = {p.name for p in generate.PROTO_DIR.glob("*_pb2*.py*")}
    assert committed == {p.name for p in fresh}, "stubs without a .proto, or .protos without stubs"
