"""Incremental detokenization: text deltas for a growing list of token ids.

A byte-level tokenizer can split one character over several tokens; until the
rest arrives the decoded tail is U+FFFD, so that tail is held back rather than
streamed and then taken back."""

from __future__ import annotations

from kervan.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # text already emitted

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids += token_ids
        full = self.tokenizer.decode(self.token_ids)
        if not final:
            full = full.rstrip(REPLACEMENT)
        if not full.startswith(self.text):  # decoding is not prefix-stable here: emit nothing twice
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
