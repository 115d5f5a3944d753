"""CUDA graphs for decode: every bucket is captured, and replaying it gives what the
eager forward gives (greedy tokens through the engine, for batches that fill a
bucket and batches padded to one). Skipped without CUDA; ``tests/gpu/run.sh``."""

import pytest
import torch

from tests.conftest import make_prompts
from worker import Engine, SamplingParams
from worker.runner.graphs import decode_buckets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_SEQS = 16


def engine(path, **options):
    return Engine.from_pretrained(path, dtype="float32", device="cuda", block_size=16, num_kv_blocks=512,
                                  max_num_seqs=MAX_SEQS, **options)


def test_replay_equals_eager_for_every_bucket(hf_models):
    path = hf_models("llama")[1]
    graphed, eager = engine(path), engine(path, enforce_eager=True)
    graphs = graphed.runner.graphs
    assert eager.runner.graphs is None
    assert sorted(graphs.graphs) == decode_buckets(MAX_SEQS)  # all captured, in a shared pool
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for batch in [*decode_buckets(MAX_SEQS), 3, 13]:  # full buckets and padded ones
        prompts = make_prompts([5 + i for i in range(batch)], seed=batch)
        replays = graphs.replays
        got = [out.token_ids for out in graphed.generate(prompts, params)]
        assert graphs.replays > replays, f"batch {batch}: no decode step replayed a graph"
        assert got == [out.token_ids for out in eager.generate(prompts, params)], f"batch {batch}"


def test_moe_models_and_enforce_eager_run_eagerly(hf_models):
    assert engine(hf_models("mixtral")[1]).runner.graphs is None  # the expert dispatch syncs with the host
