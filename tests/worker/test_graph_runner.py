"""The CUDA graph runner's CPU-checkable half: which bucket a decode batch takes, how
it is padded, and that the padded forward on the runner's static buffers (what a
graph replays) gives the eager forward's hidden states while its padding rows touch
only the padding block. ``tests/gpu/test_cuda_graphs.py`` checks capture and replay."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_engine, make_prompts
from worker.layers.paged_attention import AttentionMetadata
from worker.parallel.step_inputs import StepInputs
from worker.runner.graphs import CudaGraphRunner, bucket_for, decode_buckets, pad_decode_step


def test_buckets_are_powers_of_two_then_steps_of_eight_up_to_the_largest_batch():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]  # the largest batch is always a bucket
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 8, 9, 17, 20)] == [1, 4, 8, 8, 16, 20, 20]
    assert bucket_for(21, buckets) is None  # past the largest: eager


def test_padding_rows_use_only_the_padding_block_and_never_sample():
    step = StepInputs(token_ids=[5, 6], positions=[9, 3], slots=[41, 14], decode_tables=[[10, 2, 7], [3]],
                      decode_lens=[10, 4], logit_rows=[0, 1])
    padded = pad_decode_step(step, 4, pad_block=99, block_size=4)
    assert padded.token_ids == [5, 6, 0, 0] and padded.positions == [9, 3, 0, 0]
    assert padded.slots == [41, 14, 396, 396] and padded.decode_tables[2:] == [[99], [99]]
    assert padded.decode_lens == [10, 4, 1, 1] and padded.logit_rows == [0, 1]
    with pytest.raises(ValueError, match="decode-only step"):
        pad_decode_step(StepInputs(token_ids=[1, 2], positions=[0, 1], slots=[0, 1], prefills=[(0, 2, 0, [0])]),
                        4, 99, 4)
    with pytest.raises(ValueError, match="at most 1 rows"):
        pad_decode_step(step, 1, 99, 4)


def _scheduled(tokens: list[int], computed: int, new: int, blocks: list[int]):
    return SimpleNamespace(sequence=SimpleNamespace(token_ids=tokens), num_computed=computed, num_new_tokens=new,
                           block_ids=blocks, num_samples=1, guesses=[])


def test_the_static_buffer_forward_is_the_eager_forward_and_padding_touches_no_real_kv(llama):
    engine = make_engine(llama[1], block_size=4, num_kv_blocks=32)
    runner = engine.runner
    model, bs = runner.model, 4
    prompts = make_prompts([5, 9, 6], seed=70)
    tables = [[0, 1], [2, 3, 4], [5, 6]]
    prefill = runner.prepare([_scheduled(p, 0, len(p), t) for p, t in zip(prompts, tables)], [])
    runner.forward(prefill)
    decode = runner.prepare([_scheduled(p + [7], len(p), 1, t) for p, t in zip(prompts, tables)], [])
    before = [cache.clone() for cache in runner.kv_caches]

    def eager() -> torch.Tensor:
        meta = AttentionMetadata.build(decode.slots, decode.decode_tables, decode.decode_lens, [], bs,
                                       torch.device("cpu"), native=False)
        with torch.inference_mode():
            return model(torch.tensor(decode.token_ids), torch.tensor(decode.positions), runner.kv_caches, meta)

    expected = eager()
    after_eager = [cache.clone() for cache in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)
    graphs = CudaGraphRunner(model, runner.kv_caches, bs, max_blocks=8, pad_block=runner.pad_block,
                             buckets=decode_buckets(8))
    with torch.inference_mode():
        got = graphs.run_static(decode)  # bucket 4: one padding row
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    pad = runner.pad_block
    for cache, eager_kv, old in zip(runner.kv_caches, after_eager, before):
        # the same KV written (to rounding: 4 rows are multiplied, not 3), and not one bit
        # of a block no sequence of the step owns; the padding row wrote the padding block
        torch.testing.assert_close(cache[:, :pad], eager_kv[:, :pad], rtol=1e-5, atol=1e-5)
        assert torch.equal(cache[:, 7:pad], old[:, 7:pad])
        assert not torch.equal(cache[:, pad], old[:, pad])
    assert graphs.can_run(decode) is False  # nothing captured on the CPU: the step runs eagerly
