"""GPU shapes ``crescent plan`` knows, and the parsing of ``--gpus 8xH200`` and ``--context 1M``.

Memory is the total an engine can allocate from: ``nvidia-smi``'s total where one has been
published (``source = "nvidia-smi"``), else the datasheet's figure read as decimal gigabytes,
which errs low. ``nvlink_domain``: GPUs that share one NVLink domain (an HGX board: 8; an NVL72
rack: 72); an instance larger than that sends tensor/expert traffic over the network.
``gpus_per_node``: GPUs one Kubernetes node (one pod) can hold (an HGX server: 8; an NVL72
compute tray: 4).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuShape:
    name: str
    memory_bytes: int
    source: str                 # where memory_bytes comes from
    nvlink_domain: int
    gpus_per_node: int
    product_label: str | None   # the nvidia.com/gpu.product node label (GPU feature discovery)


GPUS: dict[str, GpuShape] = {g.name.lower(): g for g in (
    GpuShape("A100", 81_920 * MIB, "nvidia-smi (A100-SXM4-80GB)", 8, 8, "NVIDIA-A100-SXM4-80GB"),
    GpuShape("H100", 81_559 * MIB, "nvidia-smi (H100 80GB HBM3)", 8, 8, "NVIDIA-H100-80GB-HBM3"),
    GpuShape("H20", 96 * 10**9, "datasheet 96 GB", 8, 8, "NVIDIA-H20"),
    GpuShape("H200", 143_771 * MIB, "nvidia-smi (141 GB HBM3e)", 8, 8, "NVIDIA-H200"),
    GpuShape("B200", 183_359 * MIB, "nvidia-smi (192 GB HBM3e)", 8, 8, "NVIDIA-B200"),
    GpuShape("GB200", 186 * 10**9, "datasheet (NVL72: 13.4 TB / 72)", 72, 4, "NVIDIA-GB200"),
    GpuShape("B300", 288 * 10**9, "datasheet 288 GB", 8, 8, None),
    GpuShape("GB300", 288 * 10**9, "datasheet (NVL72: 20.7 TB / 72)", 72, 4, None),
)}

_GPUS_SPEC = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9]+)\s*$")
_TOKENS_SPEC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


class PlanInputError(ValueError):
    """A ``crescent plan`` argument that names nothing it knows; the message says what is accepted."""


def parse_gpus(spec: str) -> tuple[int, GpuShape]:
    """``"8xH200"`` -> (8, H200); a bare name is one GPU."""
    match = _GPUS_SPEC.match(spec)
    if match is None:
        raise PlanInputError(f"--gpus {spec!r}: expected COUNTxNAME, e.g. 8xH200")
    count = int(match.group(1) or 1)
    gpu = GPUS.get(match.group(2).lower())
    if gpu is None:
        raise PlanInputError(f"--gpus {spec!r}: unknown GPU {match.group(2)!r}; known: "
                             + ", ".join(g.name for g in GPUS.values()))
    if count < 1:
        raise PlanInputError(f"--gpus {spec!r}: need at least one GPU")
    return count, gpu


def parse_tokens(spec: str) -> int:
    """``"1M"`` -> 1,048,576; ``"128k"`` -> 131,072; a plain number as it is (binary units, as
    context windows are quoted: K3's "1M" is ``max_position_embeddings = 2**20``)."""
    match = _TOKENS_SPEC.match(spec)
    if match is None:
        raise PlanInputError(f"--context {spec!r}: expected a token count such as 131072, 128k or 1M")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20}[match.group(2).lower()]
    tokens = int(float(match.group(1)) * scale)
    if tokens < 1:
        raise PlanInputError(f"--context {spec!r}: need at least one token")
    return tokens
