"""A debug tool's channel into a ``crescent up`` run: mutual TLS with the run's ``admin``
certificate (plaintext when the run has none)."""

from __future__ import annotations

from pathlib import Path

import grpc

from crescent.services.common.grpc_service import GRPC_OPTIONS
from crescent.services.launcher import admin_tls


def admin_channel(run_dir: Path, address: str) -> grpc.Channel:
    """A blocking channel to ``address`` as the run's ``admin`` role."""
    tls = admin_tls(run_dir)
    if tls is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(address, tls.channel_credentials(), options=GRPC_OPTIONS)
