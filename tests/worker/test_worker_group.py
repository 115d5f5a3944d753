"""A worker group of two ranks (real processes, shared memory and gloo on loopback),
tensor parallel, expert parallel or two pipeline stages: it generates exactly what one
process does, for every model family and through chunked prefill, prefix hits and
n > 1 forks; a rank that dies fails the group at once instead of hanging it; the
peers die with rank 0 and live through idle time on its pings."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import MODEL_KINDS, MOE_KINDS, make_engine, make_prompts
from worker import SamplingParams
from worker.config import ConfigError, ModelConfig, check_parallel
from worker.parallel.group import GroupFailed, rendezvous, store_directory
from worker.parallel.pipeline import split
from worker.parallel.step_inputs import decode_micro_batches, encode_micro_batches

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def outputs(engine, prompts, params):
    return [[c.token_ids for c in out.outputs] for out in engine.generate(prompts, params)]


LAYOUTS = [(kind, "tensor_parallel_size") for kind in MODEL_KINDS] + \
    [(kind, "expert_parallel_size") for kind in MOE_KINDS] + [(kind, "pipeline_parallel_size") for kind in MODEL_KINDS]


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_two_ranks_generate_what_one_process_does(hf_models, kind, layout):
    path = hf_models(kind)[1]
    shared = make_prompts([12], seed=60)[0]
    prompts = [shared + p for p in make_prompts([5, 9, 23], seed=61)] + make_prompts([30], seed=62)
    options = dict(max_num_batched_tokens=16)  # the 35-token prompt prefills in chunks
    single = make_engine(path, **options)
    expected = outputs(single, prompts, GREEDY)
    forked = SamplingParams(max_tokens=6, temperature=0.9, seed=4, n=2)
    expected_forked = outputs(make_engine(path, **options), prompts[:2], forked)
    group = make_engine(path, **{layout: 2}, **options)
    try:
        # the ranks share one memory segment whose name is gone once all mapped it: none can outlive the group
        # (this process's segments: a group another test process starts meanwhile has its own)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kervan-tp-{os.getpid()}-")]
        assert outputs(group, prompts, GREEDY) == expected
        routed = group.stats().expert_tokens_per_rank  # MoE: the (token, expert) pairs each rank computed
        if kind in MOE_KINDS and layout != "pipeline_parallel_size":
            assert len(routed) == 2 and min(routed) > 0 and sum(routed) == sum(single.stats().expert_tokens_per_rank)
        else:  # a dense model; a pipeline's rank 0 sees only its own stage's experts
            assert routed == ()
        assert outputs(group, prompts, GREEDY) == expected  # again: the shared prefix now hits the cache
        assert outputs(group, prompts[:2], forked) == expected_forked  # samples fork with copy-on-write blocks
    finally:
        group.close()


def test_a_step_message_too_large_for_shared_memory_goes_over_gloo(llama):
    prompts = make_prompts([9, 14], seed=66)
    expected = outputs(make_engine(llama[1]), prompts, GREEDY)
    group = make_engine(llama[1], tensor_parallel_size=2)
    try:
        group.group.max_inline = 10  # every step's payload is larger: only its header goes through shared memory
        assert outputs(group, prompts, GREEDY) == expected
        with pytest.raises(ConfigError, match="one engine per process"):  # its layers would join the group's
            make_engine(llama[1])
    finally:
        group.close()


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_group_whose_peers_are_started_elsewhere_runs_on_gloo_alone(llama, monkeypatch, layout):
    """``KERVAN_GROUP_PEER_HOSTS`` (peers on other hosts: here an empty prefix, this host): no shared
    memory, every collective and hand-over on gloo. A pipeline of two micro-batches a step hands
    micro-batch 1 on before it takes the logits of 0: with gloo's blocking send that deadlocked
    (the hand-overs are sent without waiting now, one in flight per taker)."""
    prompts = make_prompts([20, 24, 28, 32], seed=67)
    expected = outputs(make_engine(llama[1]), prompts, GREEDY)
    monkeypatch.setenv("KERVAN_GROUP_PEER_HOSTS", "[[]]")
    monkeypatch.setenv("KERVAN_GROUP_TIMEOUT_S", "20")
    group = make_engine(llama[1], **{layout: 2})
    try:
        assert group.group.shm is None
        assert outputs(group, prompts, GREEDY) == expected
    finally:
        group.close()


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 1})).save_pretrained(tmp_path)  # one KV head
    prompts = make_prompts([7, 19], seed=65)
    expected = outputs(make_engine(tmp_path), prompts, GREEDY)
    group = make_engine(tmp_path, tensor_parallel_size=2)
    try:
        assert group.runner.model.layers[0].attn.num_kv_heads == 1
        assert outputs(group, prompts, GREEDY) == expected
    finally:
        group.close()


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_rank_that_dies_fails_the_group_at_once(llama, layout):
    group = make_engine(llama[1], **{layout: 2})
    try:
        group.add_request(make_prompts([20], seed=63)[0], SamplingParams(max_tokens=50, temperature=0))
        group.step()
        [peer] = group.group.peers
        peer.kill()
        peer.wait()
        start = time.monotonic()
        with pytest.raises(GroupFailed, match=r"rank 1 \(exit -9\)"):
            for _ in range(50):
                group.step()
        assert time.monotonic() - start < 10  # a dead peer is seen at once, not after the group timeout
        with pytest.raises(GroupFailed):  # and for good
            group.step()
    finally:
        group.close()


def test_a_rank_that_hangs_fails_the_group_after_the_group_timeout(llama, monkeypatch):
    monkeypatch.setenv("KERVAN_GROUP_TIMEOUT_S", "3")
    group = make_engine(llama[1], tensor_parallel_size=2)
    try:
        group.add_request(make_prompts([20], seed=64)[0], SamplingParams(max_tokens=50, temperature=0))
        group.step()
        [peer] = group.group.peers
        os.kill(peer.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(GroupFailed, match="no rank exited: one hangs"):
            for _ in range(50):
                group.step()
        assert 2.5 < time.monotonic() - start < 30
    finally:
        group.close()  # kills the stopped rank


PEER_SCRIPT = """
import json, sys, time
from tests.conftest import make_engine
from worker import SamplingParams
engine = make_engine(sys.argv[1], tensor_parallel_size=2)
for _ in range(8):  # 4 s idle, twice the group timeout: the pings keep the peer waiting
    time.sleep(0.5)
    engine.keepalive()
out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
print(json.dumps({"peer": engine.group.peers[0].pid, "tokens": out}), flush=True)
time.sleep(60)  # killed here, without closing the group
"""


def test_peers_live_through_idle_time_and_die_with_rank_0(llama):
    proc = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, str(llama[1])], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "KERVAN_GROUP_TIMEOUT_S": "2"})
    try:
        line = proc.stdout.readline()
        assert line, f"rank 0 exited with {proc.wait()}"
        report = json.loads(line)
        assert len(report["tokens"]) == 3
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not os.path.exists(f"/proc/{report['peer']}"):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"rank 1 (pid {report['peer']}) outlived rank 0")


LATE_PEER = """
import sys, time
from worker.parallel.group import rendezvous
time.sleep(float(sys.argv[2]))
rendezvous(1, 2, sys.argv[1], [])
time.sleep(1)
"""


def test_a_peer_slower_to_start_than_the_group_timeout_still_joins(monkeypatch):
    monkeypatch.setenv("KERVAN_GROUP_TIMEOUT_S", "1")  # hung collectives; the start has its own bound
    directory = store_directory()  # the store is a file only this user can reach: no TCP port to join
    assert directory.stat().st_mode & 0o777 == 0o700
    path = str(directory / "store")
    peer = subprocess.Popen([sys.executable, "-c", LATE_PEER, path, "3"])
    try:
        start = time.monotonic()
        store = rendezvous(0, 2, path, [peer])
        assert time.monotonic() - start > 2.5
        assert store.add("joined", 0) == 1
    finally:
        peer.kill()
        peer.wait()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_peer_that_exits_before_joining_fails_the_start_at_once():
    peer = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.monotonic()
    directory = store_directory()
    with pytest.raises(GroupFailed, match=r"rank 1 exited \(3\) before it joined"):
        rendezvous(0, 2, str(directory / "store"), [peer])
    shutil.rmtree(directory, ignore_errors=True)
    assert time.monotonic() - start < 30


def test_a_step_message_is_integers_and_a_broken_one_is_refused():
    from worker.parallel.step_inputs import StepInputs
    step = StepInputs(block_copies=[(3, 9)], token_ids=[5, 6, 7], positions=[10, 0, 1], slots=[42, 64, 65],
                      decode_tables=[[10, 2]], decode_lens=[11], prefills=[(1, 2, 0, [16])], logit_rows=[0, 2, 2])
    wire = step.encode()
    assert wire.dtype == torch.int64 and StepInputs.decode(wire) == step
    with pytest.raises(ValueError, match="truncated"):
        StepInputs.decode(wire[:-2])
    with pytest.raises(ValueError, match="past its end"):
        StepInputs.decode(torch.cat([wire, torch.tensor([7])]))
    other = StepInputs(token_ids=[1], positions=[4], slots=[4], decode_tables=[[1]], decode_lens=[5], logit_rows=[0])
    wire = encode_micro_batches([step, other])  # a pipeline's micro-batches, in one message
    assert decode_micro_batches(wire) == [step, other]
    empty = torch.tensor([], dtype=torch.int64)
    for broken in (wire[:-1], torch.cat([wire, torch.tensor([0])]), torch.tensor([0]), empty):
        with pytest.raises(ValueError, match="micro-batch message"):
            decode_micro_batches(broken)


def test_micro_batches_are_contiguous_runs_of_about_equal_tokens():
    tokens = {"d1": 1, "d2": 1, "d3": 1, "p1": 30, "p2": 12}
    cut = lambda items, parts: [[i for i in run] for run in split(items, tokens.get, parts)]  # noqa: E731
    assert cut(["d1", "d2", "d3", "p1"], 2) == [["d1", "d2", "d3"], ["p1"]]
    assert cut(["d1", "d2", "d3", "p1", "p2"], 2) == [["d1", "d2", "d3", "p1"], ["p2"]]
    assert cut(["d1", "d2", "d3"], 4) == [["d1"], ["d2"], ["d3"]]  # never an empty micro-batch
    assert cut(["d1", "d2", "d3"], 2) == [["d1", "d2"], ["d3"]]
    assert cut(["p1"], 4) == [["p1"]]


def test_sizes_that_cannot_work_are_refused_naming_the_numbers(llama, hf_models):
    model = ModelConfig.from_dir(llama[1])  # 4 heads, 2 KV heads, intermediate 96, vocabulary 128, 2 layers
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 does not divide num_attention_heads \(4\), "
                                          r"vocab_size \(128\), num_key_value_heads \(2\) and is no multiple of it"):
        check_parallel(model, 3, 1, 1, max_ranks=8)
    with pytest.raises(ConfigError, match=r"group of 4 ranks \(tensor 4 x expert 1 x pipeline 1\) exceeds the 2"):
        check_parallel(model, 4, 1, 1, max_ranks=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        check_parallel(model, 1, 1, 3, max_ranks=8)
    with pytest.raises(ConfigError, match="expert_parallel_size 2 needs a mixture-of-experts model"):
        check_parallel(model, 1, 2, 1, max_ranks=8)
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 and expert_parallel_size 4"):
        check_parallel(model, 2, 4, 1, max_ranks=8)
    with pytest.raises(ConfigError, match="pipeline_parallel_size 2 with tensor/expert parallel size 2"):
        check_parallel(model, 2, 1, 2, max_ranks=8)
    mixtral = ModelConfig.from_dir(hf_models("mixtral")[1])  # 4 experts
    with pytest.raises(ConfigError, match=r"expert_parallel_size 3 does not divide num_experts \(4\)"):
        check_parallel(mixtral, 1, 3, 1, max_ranks=8)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=f"group of {cores + 1} ranks .* exceeds the {cores} ranks"):
        make_engine(llama[1], pipeline_parallel_size=cores + 1)


DECODE_SCRIPT = """
import json, sys
from safetensors.torch import load_file
from tests.conftest import make_engine
from worker import SamplingParams
from worker.engine.engine import ImportedKV
model, layout, kv_file, first, prompt = sys.argv[1:6]
engine = make_engine(model, **({layout + "_parallel_size": 2} if layout != "none" else {}))
params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
engine.add_request(json.loads(prompt), params, request_id="r",
                   imported=ImportedKV(int(first), None, load_file(kv_file)["kv"]))
final = None
while engine.has_unfinished_requests():
    final = (engine.step() or [final])[-1]
engine.close()
print(json.dumps(final.token_ids))
"""


@pytest.mark.parametrize(("prefill_side", "decode_side"), [("tensor", None), (None, "tensor"),
                                                           ("pipeline", "tensor"), ("tensor", "pipeline")])
def test_kv_handoff_between_groups_of_other_layouts_re_shards(llama, tmp_path, prefill_side, decode_side):
    """A prompt's KV leaves a group as every layer and KV head (what one process exports),
    and each rank of the taking side keeps its part: the decode side, a process of its
    own (one group per process), generates what one process does."""
    from safetensors.torch import save_file

    from tests.worker.test_kv_handoff import prefill
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompt = make_prompts([23], seed=67)[0]
    single = make_engine(llama[1])
    [whole] = single.generate([prompt], params)
    rid, _ = prefill(single, prompt, params)
    reference = single.export_kv(rid)
    p_engine = make_engine(llama[1], **({f"{prefill_side}_parallel_size": 2} if prefill_side else {}))
    try:
        rid, first = prefill(p_engine, prompt, params)
        data = p_engine.export_kv(rid)
        assert tuple(data.shape) == p_engine.kv_block_shape(len(prompt)) == tuple(reference.shape)
        torch.testing.assert_close(data, reference, rtol=1e-5, atol=1e-5)  # gathered into one process's layout
        assert p_engine.release_kv(rid)
    finally:
        p_engine.close()
    save_file({"kv": data.contiguous()}, str(tmp_path / "kv.safetensors"))
    out = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, str(llama[1]), decode_side or "none",
                          str(tmp_path / "kv.safetensors"), str(first.token_ids[0]), json.dumps(prompt)],
                         capture_output=True, text=True, timeout=180, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == whole.token_ids
