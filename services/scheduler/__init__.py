"""The scheduler service: KV- and load-aware placement of requests on workers."""
