"""The worker service: the engine behind gRPC (roles prefill, decode, both)."""
