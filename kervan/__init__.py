"""The vocabulary every Kervan process shares: sampling parameters, request limits and
the ``InvalidRequest`` error (``sampling``), chained block hashes (``block_hash``), KV
events (``kv_events``), the tokenizer and chat template, the engine's options
(``engine_args``: the worker's flags and ``kervan up``'s are made from them), every
environment variable (``envs``) and where the embedded default model lives (``default_model``).

Free of torch and of gRPC: the router, scheduler, kv-registry and lease watch import it
and never load torch (tests hold this, for imports and for running processes). The engine
is ``worker`` (torch), the gRPC services are ``services``, the command line, the launcher
and ``kervan bench`` ``control_plane``."""
