"""The cluster KV tier across hosts: a revisited 1,024-token prefix held only in another host's
host tier is moved, not computed again, over a fast link, and computed over a slow one.

Two aggregated workers on two hosts, each with a small pool (a second long prompt evicts the
first into the host tier) and a host tier; the scheduler alternates between them (``--policy
round_robin``), so a revisit lands on the worker that did not see the document. The model is a
random Llama whose KV is 256 KiB a block: 64 blocks move in ~0.1 s at 10 Gbit/s and ~1.3 s at
100 Mbit/s, against ~0.1-0.3 s to compute 1,024 tokens here."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.hosts.link import Link
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, stream
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts
from tests.multihost.hosts import scrape

BLOCK = 16
DOC = 1024


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    path = tmp_path_factory.mktemp("wide-llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def counters(cluster: Cluster, name: str) -> dict[str, float]:
    m = scrape(cluster.addresses[f"{name}-metrics"])
    return {"computed": m[("kervan_prompt_tokens_computed_total", ())],
            "fetched": m.get(("kervan_kv_fetches_total", (("outcome", "fetched"),)), 0.0),
            "served": m.get(("kervan_kv_fetches_total", (("outcome", "served"),)), 0.0),
            "promoted": m[("kervan_kv_host_promoted_blocks_total", ())],
            "host_blocks": m[("kervan_kv_host_blocks", ())]}


def revisit(model, tmp_path, link: str) -> dict:
    cluster = Cluster(ClusterSpec(model, num_prefill=0, num_decode=0, num_both=2, hosts=3, link=Link.parse(link),
                                  tls=True, metrics=True, scheduler_args=("--policy", "round_robin"),
                                  engine=EngineArgs(**EXACT_MESH, block_size=BLOCK, num_kv_blocks=70,
                                                    kv_host_bytes=64 << 20)), tmp_path)
    cluster.start(timeout=240)
    try:
        docs = make_prompts([DOC, DOC, DOC + 72], seed=55)  # the third fills all 70 blocks of the pool
        a, b, c = [d + q for d, q in zip(docs, make_prompts([8, 8, 8], seed=56))]
        again = docs[0] + make_prompts([8], seed=57)[0]

        async def send(prompt):
            return await stream(cluster.router_address, prompt, 4, timeout=120, security=cluster.client_security)

        before = {}
        for k, prompt in enumerate([a, b, c, again]):  # round robin: a, c on one worker; b, again on the other
            if k == 3:
                before = {w: counters(cluster, w) for w in ("both-0", "both-1")}
            outs = [asyncio.run(send(prompt))]
            check(outs, greedy_tokens(model, [prompt], 4, **EXACT_REFERENCE))
        after = {w: counters(cluster, w) for w in ("both-0", "both-1")}
        return {"before": before, "after": after, "revisit": outs[0]}
    finally:
        cluster.stop()


def delta(run: dict, worker: str, key: str) -> float:
    return run["after"][worker][key] - run["before"][worker][key]


@pytest.mark.parametrize("link", ["10gbit", "100mbit"])
def test_a_prefix_in_another_hosts_host_tier_moves_over_a_fast_link_and_is_computed_over_a_slow_one(
        wide_llama, tmp_path, link):
    run = revisit(wide_llama, tmp_path, link)
    served = [w for w in ("both-0", "both-1") if delta(run, w, "computed") > 0 or delta(run, w, "fetched")]
    assert len(served) == 1, run  # the revisit ran on one worker
    lander = served[0]
    holder = "both-1" if lander == "both-0" else "both-0"
    # the third prompt (all of the pool's 70 blocks) pushed the document's 64 blocks out to the host tier
    assert run["before"][holder]["host_blocks"] >= DOC // BLOCK
    assert delta(run, holder, "computed") == 0  # the holder computed nothing for the revisit, either way
    assert delta(run, holder, "promoted") == 0  # and its prefix stayed in its host tier
    if link == "10gbit":  # moved: the lander computed only the question, the holder sent 64 blocks
        assert delta(run, lander, "fetched") == 1 and delta(run, holder, "served") == 1, run
        assert delta(run, lander, "computed") == 8, run
    else:  # computing 1,024 tokens beats moving 16 MiB at 100 Mbit/s
        assert delta(run, lander, "fetched") == 0 and delta(run, holder, "served") == 0, run
        assert delta(run, lander, "computed") == DOC + 8, run
