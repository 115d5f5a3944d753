"""The paged KV cache: block hashing, the block pool, per-request block tables, KV events."""
