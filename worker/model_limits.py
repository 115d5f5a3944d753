"""What a Hugging Face ``config.json`` says about a model's limits. Torch-free, so that
the router (which never loads the model) and the engine read them alike."""

from __future__ import annotations

DEFAULT_MAX_POSITION = 4096  # when config.json names none


def max_position(cfg: dict) -> int:
    """The longest sequence the model was trained for (prompt and output together)."""
    return cfg.get("max_position_embeddings", DEFAULT_MAX_POSITION)
