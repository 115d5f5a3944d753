"""Every sampling field survives the trip router -> worker(s): the same seeded
requests through the in-process engine and through the gRPC mesh (aggregated, and
disaggregated over shared memory and over a gRPC stream) give the same tokens,
log-probabilities and finish reasons, sample by sample.

Each variant changes one field from the base request, and the engine's answer for
it must differ from the base one: a field dropped or swapped on the way (in
``services/common/convert.py``, the router, a worker) changes what the mesh says."""

from __future__ import annotations

import pytest

from services.proto import common_pb2, router_pb2
from tests.conftest import make_engine, make_prompts
from tests.services.mesh_helpers import collect, wait_idle
from worker import SamplingParams

BASE = dict(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
VARIANTS = {  # one field changed from BASE each
    "base": {},
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.25),
    "seed": dict(seed=12),
    "logprobs": dict(logprobs=True),
    "n": dict(n=2, logprobs=True),
    "max_tokens": dict(max_tokens=7),
    "greedy": dict(temperature=0.0, logprobs=True),
}
EOS = 2
PROMPT = make_prompts([21], seed=31)[0]


def answer(out) -> list[tuple]:
    """What a client sees of each sample: tokens, log-probabilities, finish reason."""
    return [(c.token_ids, c.logprobs or [], c.finish_reason) for c in sorted(out.outputs, key=lambda c: c.index)]


@pytest.fixture(scope="module")
def expected(llama):
    """Each variant's request and the engine's answer to it, computed once for the module."""
    engine = make_engine(llama[1])

    def run(requests: dict[str, dict]) -> dict[str, list[tuple]]:
        outs = engine.generate([PROMPT] * len(requests), [SamplingParams(**r) for r in requests.values()])
        return {name: answer(out) for name, out in zip(requests, outs)}

    requests = {name: {**BASE, **v} for name, v in VARIANTS.items()}
    base = run({"base": requests["base"]})["base"][0][0]
    requests["stop_token_ids"] = {**BASE, "stop_token_ids": [base[5]]}  # its 6th token ends it
    # a seed whose sample draws EOS: with ignore_eos off it ends there
    eos_seed = next(s for s in range(200) if EOS in run({"s": {**BASE, "seed": s}})["s"][0][0])
    requests["ignore_eos"] = {**BASE, "seed": eos_seed, "ignore_eos": False}
    answers = run(requests)
    controls = {"ignore_eos": run({"c": {**BASE, "seed": eos_seed}})["c"]}
    # each variant changes what the engine says, so a field lost or swapped on the way would show
    changed = {name: answers[name] != controls.get(name, answers["base"]) for name in requests if name != "base"}
    assert all(changed.values()), changed
    return requests, answers


async def test_each_sampling_field_reaches_the_engine_through_the_mesh(llama_mesh, expected):
    requests, answers = expected
    for name, p in requests.items():
        deltas, finished = await collect(llama_mesh.router, router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=common_pb2.SamplingParams(**p)))
        reasons = {f.finished.sample_index: f.finished.finish_reason for f in finished}
        got = []
        for s in range(p.get("n", 1)):
            mine = [d.delta for d in deltas if d.delta.sample_index == s]
            logprobs = [x for d in mine for x in d.logprobs]
            got.append(([t for d in mine for t in d.token_ids], logprobs, reasons[s]))
        want = [(ids, lps, {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}[r])
                for ids, lps, r in answers[name]]
        assert [(ids, r) for ids, _, r in got] == [(ids, r) for ids, _, r in want], name
        for (_, lps, _), (_, want_lps, _) in zip(got, want):
            assert lps == pytest.approx(want_lps, abs=1e-5), name
    await wait_idle(llama_mesh)
