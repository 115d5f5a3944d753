"""Incremental detokenization: text deltas for a growing list of token ids.

A byte-level tokenizer can split one character over several tokens; until the
rest arrives the decoded tail is U+FFFD, so nothing is streamed until it is whole
(rather than streamed and then taken back)."""

from __future__ import annotations

from kervan.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Each ``add`` decodes only a window: the tokens since the previous emission and
    the ones before them (whose text is known), as vLLM's incremental detokenizer
    does, so a long answer costs O(L), not O(L^2) (re-decoding everything per delta).
    Decoding the window with the preceding tokens keeps what a tokenizer does at a
    text's start (SentencePiece drops a leading space) out of the delta."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # text already emitted
        self.prefix_offset = 0  # the window's start: tokens before it are never decoded again
        self.read_offset = 0  # tokens whose text has been emitted

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids += token_ids
        known = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if not final and window.endswith(REPLACEMENT):
            return ""  # a character still split over tokens: wait for the rest
        if len(window) <= len(known) or not window.startswith(known):
            return ""
        delta = window[len(known):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """What is still held when the sample ends without another token: bytes no later
        token completed, decoded as ``decode(all ids)`` decodes them."""
        return self.add([], final=True)
