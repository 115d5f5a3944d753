"""The kv-registry: which worker holds which KV block, and who is alive (Redis)."""
