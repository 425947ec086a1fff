"""The KV data plane's shared pieces: a block (``kv_block``) and its key (``block_keys``); the one
zero-copy codec of every stream that carries blocks (``chunk_wire``; the handoff's envelope in
``handoff_wire``; registering servicers with it in ``grpc_codecs``); copying with a CRC on the
way (``fused_copy``); the TCP side channel (``side_channel``, its TLS receiving end in
``tls_stream``) and NIXL, imported lazily (``nixl_engine``); the one mover family — movers in
order, per-peer refusals, gRPC last — that the kvstore client (its movers in
``services/kvstore/movers``) and the layer-wise handoff (``services/prefill/handoff_mover.py``)
both climb (``movers``)."""
