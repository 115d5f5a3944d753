"""The vocabulary every Kervan process shares: sampling parameters, request limits and
the ``InvalidRequest`` error (``sampling``), chained block hashes (``block_hash``), KV
events (``kv_events``), the tokenizer and every environment variable (``envs``).

Free of torch and of gRPC: the router, scheduler, kv-registry and lease watch import it
and never load torch (a test holds this). The engine is ``worker`` (torch), the gRPC
services are ``services``, the command line and launcher ``control_plane``."""
