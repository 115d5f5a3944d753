"""Text <-> token ids, from a model directory's ``tokenizer.json`` (Hugging Face
``tokenizers``). The engine works on ids; text is a convenience of the offline
API and, in the mesh, the router's job."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tok: HFTokenizer):
        self._tok = tok

    @staticmethod
    def from_dir(model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return Tokenizer(HFTokenizer.from_file(str(path))) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (at least 1): a text of B bytes is
        at least B / max_token_bytes tokens, known before encoding it."""
        if not hasattr(self, "_max_token_bytes"):
            self._max_token_bytes = max((len(t.encode()) for t in self._tok.get_vocab()), default=1) or 1
        return self._max_token_bytes
