"""Stop strings, applied by the router to each sample's streamed text.

A stop string can straddle two deltas, so the last ``len(longest) - 1`` characters
are held back until more text shows they are not the start of one (or the sample
ends): nothing is ever streamed that would have to be taken back."""

from __future__ import annotations

from kervan.sampling import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def validate_stop(stop: list[str], has_tokenizer: bool) -> None:
    if not stop:
        return
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"sampling.stop strings must be 1-{MAX_STOP_CHARS} characters, got {len(s)}")
    if not has_tokenizer:
        raise InvalidRequest("sampling.stop needs text: this model has no tokenizer (use stop_token_ids)")


class StopWatch:
    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold = max(len(s) for s in stop) - 1
        self.held = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """The text safe to stream now, and whether a stop string ended the sample
        (the text returned then ends right before it). The stop string that ends it is
        the one completed first, as if the text were checked after every character
        (of two completed at once, the longer): the answer never depends on how the
        text was split into deltas."""
        buffer = self.held + text
        found = [(i + len(s), i) for s in self.stop if (i := buffer.find(s)) >= 0]  # (end, start)
        if found:
            self.held = ""
            return buffer[:min(found)[1]], True
        cut = len(buffer) if final else max(0, len(buffer) - self.hold)
        self.held = buffer[cut:]
        return buffer[:cut], False
