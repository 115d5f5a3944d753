"""The router: Kervan's public API (tokenization, validation, streaming)."""
