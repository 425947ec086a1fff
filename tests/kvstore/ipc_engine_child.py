"""The engine's side of a same-GPU move, as a process of its own (CUDA IPC cannot open a handle
in the process that made it). ``python -m tests.kvstore.ipc_engine_child shm|cuda NBYTES SEED``:

1. fills a device tensor with ``NBYTES`` seeded bytes, prints its region (hex of ``to_bytes``);
2. on a line from stdin, allocates zeroed room of ``NBYTES``, prints its region;
3. on the next line, prints the room's bytes (hex) and exits once stdin closes.
"""

from __future__ import annotations

import sys

import torch

from crescent.services.kvstore.cuda_ipc import CudaIpc


def main() -> None:
    kind, nbytes, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if kind == "cuda":
        opener = CudaIpc()
        block = torch.empty(nbytes + 64, dtype=torch.uint8, device="cuda")[64:]  # not at its storage's start
        block.copy_(payload)  # queued: the node's open waits for it (the export's event)
        room = lambda: torch.zeros(nbytes, dtype=torch.uint8, device="cuda")  # noqa: E731
    else:
        from tests.kvstore.ipc_stand_in import ShmOpener

        opener = ShmOpener()
        block = opener.alloc(nbytes)
        block.copy_(payload)
        room = lambda: opener.alloc(nbytes).zero_()  # noqa: E731
    print(opener.export(block).to_bytes().hex(), flush=True)
    sys.stdin.readline()
    target = room()
    print(opener.export(target).to_bytes().hex(), flush=True)
    sys.stdin.readline()
    print(target.cpu().numpy().tobytes().hex(), flush=True)
    sys.stdin.read()
    if kind != "cuda":
        opener.close(unlink=True)


if __name__ == "__main__":
    main()
