"""`kervan up --speculative ngram` as real processes: the decode and aggregated workers verify
n-gram guesses, the router streams updates of several tokens, and the answers are the
engine's own without speculation — greedy tokens, a seeded sample, a stop string's cut —
with the decode worker's metrics counting the guesses under vLLM's names. Deterministic
mode (the mesh's dtype): the greedy tokens are exact by construction."""

from __future__ import annotations

import asyncio

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.cluster_helpers import complete
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, make_engine
from tests.test_cluster import sample, scrape
from worker import SamplingParams
from worker.default_model import ensure_default_model

PROMPTS = ["Once upon a time", "The cat sat on the mat. The cat sat on the", "one two three one two three one"]


def test_decode_and_aggregated_workers_speculate_and_answer_as_the_engine_without_it(tmp_path):
    model = ensure_default_model()
    reference = make_engine(model, **EXACT_REFERENCE, num_kv_blocks=None)
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    expected = reference.generate(PROMPTS, greedy)
    [expected_seeded] = reference.generate([PROMPTS[1]], seeded)
    stop = expected[1].text[20:24]
    cluster = Cluster(ClusterSpec(model, num_prefill=1, num_decode=1, num_both=1, metrics=True,
                                  engine=EngineArgs(speculative="ngram", num_speculative_tokens=4,
                                                    **EXACT_MESH)), tmp_path)
    cluster.start(timeout=240)
    try:
        async def run():
            kwargs = dict(max_tokens=48, temperature=0.0, ignore_eos=True)
            # enough requests that both the disaggregated pair and the aggregated worker serve some
            answers = [await complete(cluster, prompt=p, **kwargs) for p in PROMPTS * 2]
            cut = await complete(cluster, prompt=PROMPTS[1], stop=[stop], **kwargs)
            drawn = await complete(cluster, prompt=PROMPTS[1], max_tokens=32, temperature=0.8, top_p=0.9, seed=11,
                                   ignore_eos=True)
            return answers, cut, drawn
        answers, cut, drawn = asyncio.run(run())
        for answer, ref in zip(answers, expected * 2):
            assert answer.token_ids == ref.token_ids
        assert cut.finish_reason == "stop" and cut.text == expected[1].text[:expected[1].text.index(stop)]
        assert drawn.token_ids == expected_seeded.token_ids
        for worker in ("decode-0", "both-0"):
            metrics = scrape(cluster.addresses[f"{worker}-metrics"])
            drafts = sample(metrics, "kervan_spec_decode_num_drafts_total")
            accepted = sample(metrics, "kervan_spec_decode_num_accepted_tokens_total")
            assert drafts > 0 and accepted > 0, worker
            assert sample(metrics, "kervan_spec_decode_mean_acceptance_length") == 1 + accepted / drafts
        assert sample(scrape(cluster.addresses["prefill-0-metrics"]), "kervan_spec_decode_num_drafts_total") == 0
    finally:
        cluster.stop()
