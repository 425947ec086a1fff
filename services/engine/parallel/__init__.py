"""Tensor parallelism: one engine instance computed by a group of processes (a LeaderWorkerSet).

``settings`` (torch-free: service configs import it), ``shard`` (a rank's slice of the
checkpoint), ``group`` (the process group and the leader's commands), ``batch_wire``,
``kv_cache`` (full-layout block payloads over sharded pages), ``leader`` (the serving process's
model) and ``worker`` (the other ranks' loop). Nothing is imported here, so reading settings
does not load torch.
"""
