"""The KV data plane's shared pieces: a block (``kv_block``), its key (``block_keys``), the one
zero-copy codec of every stream that carries blocks (``chunk_wire``), and copying with a CRC on
the way (``fused_copy``). The kvstore client's byte movers live in ``services/kvstore/movers``."""
