"""A layer-wise handoff's KV through shared memory, prefill and decode on one host.

Prefill lays the prompt's block payload buffers (``layer_wire.block_buffers``) back to back in
one ``/dev/shm`` segment of its own (random name, mode 0600) and copies each layer out of its
cache straight into it. Its pages are not allocated up front: that would zero the whole KV on
the event loop before the prompt starts computing (~0.8 ms per MB here); they are faulted in by
the copies, as fresh heap buffers are, spread over the forwards. So that a full ``/dev/shm``
does not turn those faults into a SIGBUS, a segment is made only while ``/dev/shm`` has room for
it and a margin (``FREE_MARGIN``) left; the Handoff stream then carries only control: the header naming the segment,
per slice a note (``LayerSliceMeta`` with no data, its ``crc32`` set), the state's note and the
tail. Decode maps the segment when the header comes, if it sees the very file prefill made
(``shm_files.file_identity``: same kernel, same file), unlinks its name (both hold the mapping,
nothing else needs the name), checks each note's CRC over the mapped bytes as it arrives and
takes the payloads as views of the mapping: they are copied into its cache on admission, and the
mapping goes when the last view does. A decode that cannot map it refuses with
FAILED_PRECONDITION and ``REFUSAL`` in the details; prefill sends the stream again with the
bytes (``prefill/layerwise.py``).

Names are ``crescent-handoff-<instance tag>-<pid>-<random>``: a prefill instance removes its
own leftovers (a crashed process's) when it starts (``sweep``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import secrets

from crescent.protos import common_pb2, decode_pb2
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.fused_copy import crc32
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, LayerLayout, block_tokens, layer_piece
from crescent.services.kvwire.shm_files import SHM_DIR, file_identity

NAME_PREFIX = "crescent-handoff-"
_NAME = re.compile(r"^crescent-handoff-[0-9a-f]{8}-[0-9]{1,10}-[0-9a-f]{24}$")
REFUSAL = "shm handoff:"  # how decode's FAILED_PRECONDITION details start when it cannot map a segment
FREE_MARGIN = 0.25  # of /dev/shm's size kept free besides a new segment (others' segments, the kvstore's)


class ShmUnusable(OSError):
    """This process cannot make or map a handoff segment (another host, a full /dev/shm, ...)."""


def instance_tag(instance_id: str) -> str:
    """A file-name-safe tag of a prefill instance id (ids are unique, and stable across restarts)."""
    return hashlib.sha256(instance_id.encode()).hexdigest()[:8]


class HandoffSegment:
    """One handoff's segment: ``create``d by prefill, ``attach``ed by decode. ``buf`` is the
    mapping; it stays mapped as long as any view of it lives (no explicit unmap: the payloads
    and the kvstore export's blocks are views of it)."""

    def __init__(self, name: str, identity: str, mapping: mmap.mmap) -> None:
        self.name, self.identity = name, identity
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, tag: str, size: int) -> HandoffSegment:
        """A fresh segment of ``size`` bytes, its pages allocated now; ``ShmUnusable`` if not."""
        name = f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(12)}"
        path = SHM_DIR / name
        fs = os.statvfs(SHM_DIR)
        if size > fs.f_bavail * fs.f_frsize - FREE_MARGIN * fs.f_blocks * fs.f_frsize:
            raise ShmUnusable(f"{SHM_DIR} has {fs.f_bavail * fs.f_frsize >> 20} MiB free; a handoff of "
                              f"{size >> 20} MiB would leave less than {FREE_MARGIN:.0%} of it")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ShmUnusable(f"cannot create {path}: {exc}") from exc
        try:
            os.ftruncate(fd, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
            identity = file_identity(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise ShmUnusable(f"cannot allocate {size} bytes in {SHM_DIR}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(name, identity, mapping)

    @classmethod
    def attach(cls, name: str, identity: str, size: int) -> HandoffSegment:
        """Map prefill's segment ``name`` and unlink its name; ``ShmUnusable`` when this process
        does not see that very file of ``size`` bytes."""
        if not _NAME.match(name):
            raise ShmUnusable(f"{name!r} is not a handoff segment name")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmUnusable(f"cannot open {path} ({errno.errorcode.get(exc.errno, exc.errno)}): "
                              "another host, pod or user") from exc
        try:
            if file_identity(fd) != identity:
                raise ShmUnusable(f"{path} here is not prefill's segment (another host or mount)")
            actual = os.fstat(fd).st_size
            if actual != max(size, 1):
                raise ShmUnusable(f"{path} has {actual} bytes; the handoff's buffers take {size}")
            mapping = mmap.mmap(fd, actual, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()  # both processes hold the mapping; the name is no longer needed
        return cls(name, identity, mapping)

    def unlink(self) -> None:
        """Remove the name (the memory goes once every mapping of it is gone)."""
        (SHM_DIR / self.name).unlink(missing_ok=True)


def sweep(tag: str) -> int:
    """Remove segments of instance ``tag`` whose process is gone (a crash); how many. A live
    process's are kept: two instances with one id (ports chosen by the kernel) must not clash."""
    removed = 0
    for path in SHM_DIR.glob(f"{NAME_PREFIX}{tag}-*"):
        if _NAME.match(path.name) and not _alive(int(path.name.split("-")[3])):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def layer_note(layer: int, first: int, num_blocks: int, last_block_tokens: int, nbytes: int, crc: int) -> WireChunk:
    """A ``LayerSlice`` without data: layer ``layer`` of blocks ``first ..`` landed in the segment."""
    meta = decode_pb2.LayerSliceMeta(layer=layer, first_block=first, num_blocks=num_blocks,
                                     last_block_tokens=last_block_tokens, nbytes=nbytes, crc32=crc)
    return WireChunk(meta=meta, last=True)


def state_note(meta: common_pb2.BlockMeta, crc: int) -> WireChunk:
    """The state's piece without data: the last block's state is final in the segment."""
    noted = common_pb2.BlockMeta()
    noted.CopyFrom(meta)
    noted.checksum = crc
    return WireChunk(meta=noted, last=True)


class MappedLayerAssembler(LayerAssembler):
    """A ``LayerAssembler`` whose payload buffers are prefill's segment: each note is checked
    (order, range, length as a slice's, then the CRC of its bytes there) instead of copied."""

    where = "shared memory"  # for errors: where the bytes are

    def __init__(self, layout: LayerLayout, prompt_tokens: int, block_size: int, mapped: HandoffSegment | memoryview) -> None:
        """``mapped``: the segment, or a buffer the bytes land in otherwise (the TCP side channel's,
        ``handoff_tcp.py``), laid out as a segment is."""
        super().__init__(layout, prompt_tokens, block_size, into=mapped.buf if isinstance(mapped, HandoffSegment) else mapped)
        self.segment = mapped if isinstance(mapped, HandoffSegment) else None

    def feed(self, chunk: WireChunk) -> None:
        meta = chunk.meta
        if not isinstance(meta, decode_pb2.LayerSliceMeta) or not chunk.last:
            raise BlockFormatError("a layer slice comes in one message, with its meta")
        if len(chunk.data):
            raise BlockFormatError("a layer slice with data in a shared memory handoff")
        self._check_slice(meta, meta.nbytes)
        crc = self._slice_crc(meta)
        if crc != meta.crc32:
            raise BlockFormatError(f"layer {meta.layer} of blocks [{meta.first_block}, {meta.first_block + meta.num_blocks}) "
                                   f"in {self.where}: CRC32 {crc:08x}, the note says {meta.crc32:08x}")
        self._took(meta)

    def _slice_crc(self, meta: decode_pb2.LayerSliceMeta) -> int:
        """The CRC32 of the slice ``meta`` names, over its bytes where they lie."""
        crc = 0
        for block in range(meta.first_block, meta.first_block + meta.num_blocks):
            tokens = block_tokens(block, self.prompt_tokens, self.block_size)
            crc = crc32(layer_piece(self.layout, self._buffers[block][self._heads[block] :], tokens, meta.layer), crc)
        return crc

    def _state_crc(self, head: int) -> int:
        return crc32(self._buffers[-1][:head])

    def feed_state(self, chunk: WireChunk) -> None:
        if not self.layout.state_bytes:
            raise BlockFormatError("a recurrent state in the handoff of a cache without states")
        if self._state_done:
            raise BlockFormatError("the recurrent state arrived again")
        head = self._heads[-1]
        if chunk.meta is None or not chunk.last or len(chunk.data) or chunk.meta.nbytes != head:
            raise BlockFormatError(f"a shared memory handoff's state comes as one note of {head} bytes")
        crc = self._state_crc(head)
        if crc != chunk.meta.checksum:
            raise BlockFormatError(f"the recurrent state in {self.where}: CRC32 {crc:08x}, "
                                   f"the note says {chunk.meta.checksum:08x}")
        self._state_done = True
        self.received += head
