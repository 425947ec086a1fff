"""Vendor peak figures of the GPUs a kernel benchmark compares itself against.

Dense (no sparsity) bf16 tensor-core TFLOP/s and HBM bandwidth in GB/s (10^9 B/s), from the
vendors' data sheets for the SXM parts unless the name says otherwise. Keyed by a substring of
``torch.cuda.get_device_name()``; the longest matching key wins ("H100 PCIe" before "H100").
Measured figures sit below these: an H200 here ran an 8192³ bf16 torch matmul at ~790 TFLOP/s
and a device-to-device copy at ~4.3 TB/s (/work/.library/device/KINDS.md, 2026-10/11).

    python loadtest/gpu_peaks.py "NVIDIA H200"     # prints: NVIDIA H200 bf16_tflops=989 hbm_gbs=4800
"""

from __future__ import annotations

import sys

# name substring -> (dense bf16 TFLOP/s, HBM GB/s)
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 4800.0),
    "GH200": (989.0, 4000.0),
    "H100 PCIe": (756.0, 2000.0),
    "H100 NVL": (835.0, 3900.0),
    "H100": (989.0, 3350.0),
    "H800": (989.0, 3350.0),
    "B200": (2250.0, 8000.0),
    "A100-SXM4-80GB": (312.0, 2039.0),
    "A100 80GB PCIe": (312.0, 1935.0),
    "A100": (312.0, 1555.0),
    "L40S": (362.0, 864.0),
    "L4": (121.0, 300.0),
}


def peaks_for(device_name: str) -> tuple[float, float] | None:
    """(bf16 TFLOP/s, HBM GB/s) of the device, or None for a device not in the table."""
    matches = [key for key in PEAKS if key.lower() in device_name.lower()]
    return PEAKS[max(matches, key=len)] if matches else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_peaks.py DEVICE_NAME", file=sys.stderr)
        return 2
    peak = peaks_for(argv[0])
    if peak is None:
        print(f"{argv[0]} bf16_tflops=unknown hbm_gbs=unknown (not in loadtest/gpu_peaks.py's table)")
    else:
        print(f"{argv[0]} bf16_tflops={peak[0]:g} hbm_gbs={peak[1]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
