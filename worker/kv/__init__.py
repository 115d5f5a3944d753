"""The paged KV cache: the block pool and per-sequence block tables (the block hashes and
KV events they produce are the shared vocabulary in ``kervan``)."""
