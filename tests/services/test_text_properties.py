"""Properties of the router's text path over inputs hypothesis draws: stop strings
however the text is split into deltas, and incremental detokenization however the
tokens arrive."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kervan.tokenizer import Tokenizer
from services.router.detokenizer import Detokenizer
from services.router.stop_strings import StopWatch

ALPHABET = "abcE \u00e9\u4e16"  # a few letters, a space and multi-byte characters


def split(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_stop_strings_cut_the_text_before_the_first_one_completed_however_it_is_split(data):
    text = data.draw(st.text(ALPHABET, max_size=30))
    stop = data.draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
    pieces = split(data.draw, text)
    watch, streamed, hit = StopWatch(stop), "", False
    for k, piece in enumerate(pieces):
        out, hit = watch.feed(piece, final=k == len(pieces) - 1)
        streamed += out
        if hit:
            break
    # the first stop string completed ends the text (checked after every character)
    first = next(((end, start) for end in range(len(text) + 1) for start in range(end)
                  if text[start:end] in stop), None)
    assert hit == (first is not None)
    assert streamed == (text[:first[1]] if first else text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_detokenized_deltas_add_up_to_the_decoded_text_however_tokens_arrive(default_model_dir, data):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    text = data.draw(st.text(ALPHABET + "xyz.,", max_size=40))
    ids = tokenizer.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    detok, streamed = Detokenizer(tokenizer), ""
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    for k, chunk in enumerate(chunks):
        delta = detok.add(chunk, final=k == len(chunks) - 1)
        assert "\ufffd" not in delta or k == len(chunks) - 1  # a split character is held, not streamed
        streamed += delta
    assert streamed == tokenizer.decode(ids)


def test_detokenizing_a_long_answer_token_by_token_decodes_each_token_a_bounded_number_of_times(
        default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    ids = tokenizer.encode("Once upon a time, a caf\u00e9 stood by the sea. " * 40)
    decoded = []
    real = tokenizer.decode
    tokenizer.decode = lambda token_ids: decoded.append(len(token_ids)) or real(token_ids)
    detok, streamed = Detokenizer(tokenizer), ""
    for k, token in enumerate(ids):
        streamed += detok.add([token], final=k == len(ids) - 1)
    assert streamed == real(ids)
    assert sum(decoded) < 6 * len(ids)  # re-decoding everything each time was len(ids)**2 / 2 (> 100x here)


def lone_bytes(tokenizer: Tokenizer) -> list[int]:
    """The ids that decode to U+FFFD alone: a byte of a multi-byte character."""
    return [i for i in range(len(tokenizer.vocabulary())) if tokenizer.decode([i]) == "\ufffd"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_token_ids_stream_as_their_decoded_text_with_nothing_partial_printed_early(default_model_dir, data):
    """Ids a random model may sample, lone bytes of multi-byte characters among them, in any
    split: the deltas add up to ``decode(ids)``, a delta ends in U+FFFD only where the whole
    text has one (bytes that never became a character), and a sample that ends without a
    last token gives what was held through ``flush``."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    num_tokens = len(tokenizer.vocabulary())
    ids = data.draw(st.lists(st.one_of(st.sampled_from(lone_bytes(tokenizer)), st.integers(0, num_tokens - 1)),
                             max_size=30))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    ends_with_flush = data.draw(st.booleans())
    whole = tokenizer.decode(ids)
    detok, streamed = Detokenizer(tokenizer), ""
    for k, chunk in enumerate(chunks):
        delta = detok.add(chunk, final=k == len(chunks) - 1 and not ends_with_flush)
        streamed += delta
        if delta.endswith("\ufffd"):
            assert whole[len(streamed) - 1] == "\ufffd"
    streamed += detok.flush() if ends_with_flush else ""
    assert streamed == whole


def test_a_sample_that_ends_without_a_token_still_streams_the_bytes_held_for_it(default_model_dir):
    """A lone byte of a multi-byte character, then the end with no further token (an abort, a
    length cut by the worker): the held byte goes out, as U+FFFD, before the sample's end."""
    import time

    from services.proto import common_pb2, worker_pb2
    from services.router.sample_stream import SampleStream
    tokenizer = Tokenizer.from_dir(default_model_dir)
    word, byte = tokenizer.encode("caf"), [lone_bytes(tokenizer)[0]]
    ids = word + byte
    sample = SampleStream("r", 0, tokenizer, [], num_prompt_tokens=3, start=time.perf_counter())
    first = sample.take(worker_pb2.TokenUpdate(token_ids=word), attempt=0, cached_prompt_tokens=0)
    held = sample.take(worker_pb2.TokenUpdate(index=len(word), token_ids=byte), attempt=0, cached_prompt_tokens=0)
    assert [r.delta.text for r in first + held] == ["caf", ""]  # the byte is held
    last = sample.take(worker_pb2.TokenUpdate(finish_reason=common_pb2.FINISH_REASON_ABORT), attempt=0,
                       cached_prompt_tokens=0)
    assert [r.WhichOneof("kind") for r in last] == ["delta", "finished"]
    assert last[0].delta.text == "\ufffd" and not last[0].delta.token_ids
    assert "caf" + last[0].delta.text == tokenizer.decode(ids)
