"""Speculative decoding in the engine: with n-gram or draft-model guesses a request's tokens are
the ones it gets without speculation — greedy, seeded samples, n > 1, stop ids, max_tokens,
small budgets, preemption — and the slots of rejected guesses come back and never reach the
prefix cache. float32 (tiny models with far-apart top logits); bit-identical logprobs with
deterministic mode. A verifier that keeps every guess fails these tests."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from kervan.block_hash import hash_blocks
from kervan.kv_events import BlockStored
from tests.conftest import TINY, make_engine, make_prompts
from tests.worker.test_engine import assert_idle
from worker import SamplingParams
from worker.config import ConfigError
from worker.kernels import has_native_kernels

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)
# tiny random models fall into loops, which n-grams then guess: prompts of a few lengths
PROMPTS = make_prompts([11, 30, 5, 17], seed=3)
NGRAM = dict(speculative="ngram", num_speculative_tokens=3)


def _tokenizer(path, vocab: list[str]):
    from tokenizers import Tokenizer, models
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    tokenizer.save(str(path / "tokenizer.json"))


WORDS = [f"w{i}" for i in range(TINY["vocab_size"])]


@pytest.fixture(scope="module")
def target(tmp_path_factory, llama):
    """The tiny llama (a copy: the session's has no tokenizer) with a word-level tokenizer of its 128 ids."""
    path = tmp_path_factory.mktemp("target")
    shutil.copytree(llama[1], path, dirs_exist_ok=True)
    _tokenizer(path, WORDS)
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory, target):
    """A smaller random model (one layer, another seed) with the target's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("draft")
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 1})).eval().save_pretrained(path)
    _tokenizer(path, WORDS)
    return path


def _run(path, prompts, params, **options):
    engine = make_engine(path, **options)
    outs = engine.generate(prompts, params)
    return engine, outs


def _same(reference, outs, exact: bool = False):
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref.token_ids
        if exact:
            assert out.logprobs == ref.logprobs
        else:
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def _accepted(engine) -> int:
    stats = engine.stats()
    assert stats.spec_num_drafts > 0
    return stats.spec_num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-is-target"])
def test_greedy_tokens_and_logprobs_are_the_targets(target, draft, method):
    options = NGRAM if method == "ngram" else dict(speculative="draft", num_speculative_tokens=4,
                                                   speculative_model=str(target if method == "draft-is-target"
                                                                         else draft))
    _, reference = _run(target, PROMPTS, GREEDY)
    engine, outs = _run(target, PROMPTS, GREEDY, **options)
    _same(reference, outs)
    accepted = _accepted(engine)
    if method == "draft-is-target":  # the target guessing itself: every guess kept
        assert accepted == engine.stats().spec_num_draft_tokens
    else:
        assert accepted > 0
    assert_idle(engine)
    assert not engine.proposer.__dict__.get("shadows")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_sample_gets_the_same_tokens_as_without_speculation(target, draft, method):
    options = NGRAM if method == "ngram" else dict(speculative="draft", speculative_model=str(draft))
    params = [SEEDED, dataclasses.replace(SEEDED, seed=8, n=3, top_k=20, min_p=0.05)]
    prompts = [PROMPTS[0], PROMPTS[1]]
    _, reference = _run(target, prompts, params)
    engine, outs = _run(target, prompts, params, **options)
    for ref, out in zip(reference, outs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        for a, b in zip(out.outputs, ref.outputs):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert engine.stats().spec_num_drafts > 0
    assert_idle(engine)


def test_a_draft_that_is_the_target_has_every_sampled_guess_accepted(target):
    """Unseeded samples take guesses drawn from the draft's distribution and rejection
    sampling: with the target as its own draft p = q, so nothing may be rejected (a
    misaligned row or a mismatched temperature would reject); the logprobs are the target's
    of the tokens rejection sampling drew."""
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=40, top_p=0.95, min_p=0.01, ignore_eos=True,
                            logprobs=True)
    engine, outs = _run(target, PROMPTS, params, speculative="draft", speculative_model=str(target),
                        num_speculative_tokens=3)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 50
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert all(len(o.token_ids) == 30 for o in outs)
    assert all(len(o.logprobs) == 30 and all(-30 < lp <= 0 for lp in o.logprobs) for o in outs)
    assert_idle(engine)


def test_stop_ids_and_max_tokens_cut_a_run_of_accepted_guesses(target):
    [ref] = make_engine(target).generate([PROMPTS[1]], GREEDY)
    stop = ref.token_ids[12]
    first = ref.token_ids.index(stop)
    engine = make_engine(target, **NGRAM)
    [stopped] = engine.generate([PROMPTS[1]], dataclasses.replace(GREEDY, stop_token_ids=[stop]))
    assert stopped.token_ids == ref.token_ids[:first + 1] and stopped.finish_reason == "stop"
    for max_tokens in (1, 2, 5, 17):
        [out] = engine.generate([PROMPTS[1]], dataclasses.replace(GREEDY, max_tokens=max_tokens))
        assert out.token_ids == ref.token_ids[:max_tokens] and out.finish_reason == "length"
    assert_idle(engine)


def test_small_budgets_and_preemption_keep_the_tokens(target):
    _, reference = _run(target, PROMPTS, GREEDY)
    for options in (dict(max_num_batched_tokens=2), dict(num_kv_blocks=24)):
        engine, outs = _run(target, PROMPTS, GREEDY, **NGRAM, **options)
        _same(reference, outs)
        assert_idle(engine)
    assert engine.stats().num_preemptions > 0


def test_rejected_guesses_give_their_blocks_back_and_never_reach_the_prefix_cache(target):
    engine = make_engine(target, **{**NGRAM, "num_speculative_tokens": 4})
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final = {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        for seq in engine.scheduler.running:  # after each step no block past a sequence's tokens
            assert len(engine.kv.tables[seq.seq_id]) <= -(-seq.num_tokens // 4)
    outs = [final[i] for i in ids]
    assert engine.stats().spec_num_draft_tokens > engine.stats().spec_num_accepted_tokens  # some were rejected
    real = set()
    for prompt, out in zip(PROMPTS, outs):
        real.update(hash_blocks(prompt + out.token_ids, 4))
    stored = [h for e in engine.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored and set(stored) <= real
    # the cached blocks hold the real tokens' KV: continuing from a cached prefix gives the same tokens
    prompt, out = PROMPTS[1], outs[1]
    [again] = engine.generate([prompt + out.token_ids[:20]], dataclasses.replace(GREEDY, max_tokens=20))
    assert again.num_cached_tokens >= 40 and again.token_ids == out.token_ids[20:40]
    assert_idle(engine)


def test_speculation_stops_when_the_batch_is_large(target):
    engine, _ = _run(target, PROMPTS, GREEDY, **NGRAM, speculative_disable_by_batch_size=2)
    assert engine.stats().spec_num_drafts == 0
    engine, _ = _run(target, PROMPTS[:2], GREEDY, **NGRAM, speculative_disable_by_batch_size=2)
    assert engine.stats().spec_num_drafts > 0


def test_a_verifier_that_keeps_every_guess_fails_the_exactness_test(target, monkeypatch):
    import worker.spec.verifier as verifier

    def keep_all(targets, guesses):
        kept = torch.full((targets.shape[0],), guesses.shape[1])
        return kept, targets[:, -1]
    monkeypatch.setattr(verifier, "accept_matching", keep_all)
    _, reference = _run(target, PROMPTS, GREEDY)
    _, outs = _run(target, PROMPTS, GREEDY, **NGRAM)
    assert any(o.token_ids != r.token_ids for o, r in zip(outs, reference))


@pytest.mark.isa
@pytest.mark.skipif(not has_native_kernels(), reason="deterministic mode needs the native kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_keeps_logprobs_bit_identical(target, dtype):
    options = dict(dtype=dtype, deterministic=True)
    _, reference = _run(target, PROMPTS, GREEDY, **options)
    engine, outs = _run(target, PROMPTS, GREEDY, **options, **NGRAM)
    _same(reference, outs, exact=True)
    assert _accepted(engine) > 0


def test_bad_speculative_configs_are_config_errors(target, tmp_path):
    with pytest.raises(ConfigError, match="unknown"):
        make_engine(target, speculative="medusa")
    with pytest.raises(ConfigError, match="needs speculative_model"):
        make_engine(target, speculative="draft")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_engine(target, speculative="ngram", num_speculative_tokens=0)
    from transformers import LlamaConfig, LlamaForCausalLM
    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 1})).save_pretrained(other)
    _tokenizer(other, list(reversed(WORDS)))
    with pytest.raises(ConfigError, match="another tokenizer"):
        make_engine(target, speculative="draft", speculative_model=str(other))
    wider = tmp_path / "wider"
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 1, "vocab_size": 256})).save_pretrained(wider)
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(target, speculative="draft", speculative_model=str(wider))


def test_the_proposers_are_the_command_lines_methods_and_a_new_one_registers_itself(monkeypatch):
    """Each proposer's file registers itself under the name ``kervan.speculative`` lists for the
    command line (torch-free), and ``make_proposer`` builds what is registered."""
    from kervan.speculative import SPECULATIVE_METHODS
    from worker.spec import proposer
    assert proposer.proposer_names() == sorted(SPECULATIVE_METHODS)
    monkeypatch.setattr(proposer, "PROPOSERS", dict(proposer.PROPOSERS))
    made = []
    proposer.register_proposer("echo")(lambda config, target, target_dir: made.append(target_dir) or "echo-proposer")
    monkeypatch.setattr(proposer, "proposer_names", lambda: sorted(proposer.PROPOSERS))

    class Config:
        speculative, world_size = "echo", 1
    assert proposer.make_proposer(Config(), None, "/models/m") == "echo-proposer" and made == [Path("/models/m")]
    Config.world_size = 2  # a proposer with a model of its own runs in one process
    with pytest.raises(ConfigError, match="one process"):
        proposer.make_proposer(Config(), None, "/models/m")
