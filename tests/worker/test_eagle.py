"""EAGLE: the head Kervan serves computes what the training module computes (same weights,
saved and loaded); trained for a tiny random target on its own answers, it guesses tokens the
target keeps, and the engine's tokens are the target's without it — greedy and seeded.
Training here is seconds on a tiny model: the data, the loop and the file format are the
ones ``python -m control_plane.tools.train_eagle`` runs for a real model. Greedy tokens are compared
in float32 with the default kernels (the tiny model's wide init keeps top logits apart), not
deterministic mode."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from control_plane.tools.eagle_data import generate_examples, reference_passages, stdlib_docstrings
from control_plane.tools.train_eagle import TrainingHead, draft_vocabulary, evaluate, train
from tests.conftest import make_engine, make_prompts
from tests.worker.test_engine import assert_idle
from worker import SamplingParams
from worker.batch import ScheduledSequence
from worker.config import ConfigError
from worker.kv.kv_cache_manager import KVCacheManager
from worker.runner.model_runner import ModelRunner
from worker.spec.eagle import EagleShadow
from worker.spec.eagle_head import CONFIG_FILE, WEIGHTS_FILE, load_eagle_head

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=True)


def _frozen(engine, vocab):
    model = engine.runner.model
    with torch.no_grad():
        embed = model.embed(torch.arange(model.cfg.vocab_size)).float()
        lm_head = model.compute_logits(torch.eye(model.cfg.hidden_size)).T.float().contiguous()
    return embed, lm_head, vocab


def _save(head: TrainingHead, vocab, engine, out, intermediate):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in head.kervan_tensors().items()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    cfg = engine.model_config
    (out / CONFIG_FILE).write_text(json.dumps({"hidden_size": cfg.hidden_size, "target_vocab_size": cfg.vocab_size,
                                               "intermediate_size": intermediate, "draft_vocab_size": len(vocab)}))
    return out


def test_the_served_head_computes_what_the_training_module_computes(llama, tmp_path):
    _, path = llama
    engine = make_engine(path)
    vocab = torch.arange(0, 128, 2)
    torch.manual_seed(0)
    trained = TrainingHead(path, 80, *_frozen(engine, vocab))
    for p in trained.parameters():
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    head = load_eagle_head(_save(trained, vocab, engine, tmp_path / "head", 80), engine.runner.model,
                           torch.float32, 512, "cpu")
    # the reference runs on the weights as saved (bf16)
    saved = {k: v.float() for k, v in trained.kervan_tensors().items() if k != "vocab"}
    trained.fc.weight.data.copy_(saved["fc.weight"])
    trained.norm.weight.data.copy_(saved["norm.weight"])
    trained.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in saved.items() if k != "fc.weight"
                                   and k != "norm.weight"})
    tokens, features = torch.randint(3, 128, (12,)), torch.randn(12, 64)
    expected = trained(tokens[None], features[None])[0]
    runner = ModelRunner(head, dataclasses.replace(engine.config, speculative=None))
    runner.keep_hidden = True
    kv = KVCacheManager(engine.config.num_kv_blocks, 4, enable_caching=False)
    shadow = EagleShadow("s", 0, tokens.tolist())
    # as a chunk of 7, then five rows one at a time (decode rows): positions continue across calls
    kv.allocate_slots(shadow, 12)
    got = []
    for start, n in [(0, 7)] + [(p, 1) for p in range(7, 12)]:
        step = runner.prepare([ScheduledSequence(shadow, start, n, kv.get_block_ids("s"), 1)], [])
        step.logit_rows = list(range(n))
        logits = runner.forward(step, carried=features[start:start + n])
        got.append(runner.last_hidden)
        torch.testing.assert_close(logits, runner.last_hidden @ trained.lm_rows.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


@dataclasses.dataclass
class Trained:
    dir: object  # the head as Kervan loads it
    module: TrainingHead  # the training module, holding the weights as saved (bf16)
    vocab: torch.Tensor
    accuracy_before: float
    accuracy_after: float


def _as_saved(module: TrainingHead, vocab) -> TrainingHead:
    saved = {k: v.float() for k, v in module.kervan_tensors().items() if k != "vocab"}
    module.fc.weight.data.copy_(saved.pop("fc.weight"))
    module.norm.weight.data.copy_(saved.pop("norm.weight"))
    module.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in saved.items()})
    return module


@pytest.fixture(scope="module")
def trained_head(llama, tmp_path_factory) -> Trained:
    """A head trained for the tiny llama on its own greedy and sampled answers to random prompts."""
    _, path = llama
    engine = make_engine(path, enable_prefix_caching=False, num_kv_blocks=1024)
    examples = generate_examples(engine, make_prompts([12, 20, 7, 30] * 50, seed=40), max_tokens=48)
    vocab = draft_vocabulary(examples, 128)
    torch.manual_seed(0)
    head = TrainingHead(path, 96, *_frozen(engine, vocab))
    before = evaluate(head, examples[:8])
    train(head, examples[8:], epochs=12, lr=3e-3, batch_tokens=1024, seed=0, say=lambda _: None)
    after = evaluate(head, examples[:8])
    out = _save(head, vocab, engine, tmp_path_factory.mktemp("eagle"), 96)
    return Trained(out, _as_saved(head, vocab), vocab, before, after)


def test_training_teaches_the_head_the_targets_next_tokens(trained_head):
    """Held-out answers of a random model: the head learns something, not much (a real model's
    text is far more predictable: benchmarks/README.md has SmolLM2's numbers)."""
    assert trained_head.accuracy_after > trained_head.accuracy_before + 0.03


def test_the_engines_first_guess_is_the_training_modules_prediction(llama, trained_head):
    """The proposer feeds the head the right hidden states and tokens at the right positions:
    every first guess while a request decodes is the training module's argmax on the whole
    sequence with the target's hidden states (float32: no near-ties to flip)."""
    _, path = llama
    engine = make_engine(path, speculative="eagle", speculative_model=str(trained_head.dir))
    rid = engine.add_request(make_prompts([11], seed=3)[0], dataclasses.replace(GREEDY, max_tokens=30))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.groups.get(rid, [None])[0]
        if seq is not None and seq.draft_tokens:
            seen.append((list(seq.token_ids), seq.draft_tokens[0]))
    [full] = generate_examples(make_engine(path, enable_prefix_caching=False), [seen[-1][0]], max_tokens=1)
    module = trained_head.module
    assert len(seen) > 10
    for tokens, guess in seen:
        n = len(tokens)
        with torch.no_grad():
            g = module(torch.tensor(tokens[1:])[None], full.hidden[:n - 1].float()[None])[0, -1]
        assert trained_head.vocab[(g @ module.lm_rows.T).argmax()] == guess


def test_eagle_guesses_are_kept_and_the_tokens_are_the_targets(llama, trained_head):
    _, path = llama
    prompts = make_prompts([11, 30, 5, 17], seed=3)
    seeded = [dataclasses.replace(GREEDY, temperature=0.8, top_p=0.9, seed=5), GREEDY,
              dataclasses.replace(GREEDY, temperature=0.7, seed=6, n=2), GREEDY]
    for params in (GREEDY, seeded):
        reference = make_engine(path).generate(prompts, params)
        engine = make_engine(path, speculative="eagle", speculative_model=str(trained_head.dir),
                             num_speculative_tokens=3)
        outs = engine.generate(prompts, params)
        for ref, out in zip(reference, outs):
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
            for a, b in zip(out.outputs, ref.outputs):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        stats = engine.stats()
        assert stats.spec_num_accepted_tokens > 0
        assert_idle(engine)
        assert not engine.proposer.shadows


def test_eagle_after_a_prefix_hit_and_preemption_keeps_the_tokens(llama, trained_head):
    """The head starts where the target computed: after a prefix-cache hit, and again after
    a preempted sequence is recomputed."""
    _, path = llama
    prompts = make_prompts([30, 30, 30, 30], seed=8)
    prompts = [prompts[0]] + [prompts[0][:24] + p[24:] for p in prompts[1:]]  # shared prefix blocks
    reference = make_engine(path).generate(prompts, GREEDY)
    engine = make_engine(path, speculative="eagle", speculative_model=str(trained_head.dir), num_kv_blocks=40)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert any(o.num_cached_tokens for o in outs) and engine.stats().num_preemptions > 0
    assert engine.stats().spec_num_accepted_tokens > 0
    assert_idle(engine)


def test_a_head_for_another_model_or_none_is_a_config_error(llama, trained_head, tmp_path):
    _, path = llama
    with pytest.raises(ConfigError, match="no EAGLE head ships"):
        make_engine(path, speculative="eagle")
    wrong = tmp_path / "wrong"
    shutil.copytree(trained_head.dir, wrong)
    meta = json.loads((wrong / CONFIG_FILE).read_text())
    (wrong / CONFIG_FILE).write_text(json.dumps({**meta, "hidden_size": 576}))
    with pytest.raises(ConfigError, match="trained for a model"):
        make_engine(path, speculative="eagle", speculative_model=str(wrong))


def test_the_training_texts_keep_their_held_out_files_and_topics_apart():
    """What ``train_eagle`` learns from never includes what the benchmark measures on."""
    docs, held_docs = stdlib_docstrings(held_out=False), stdlib_docstrings(held_out=True)
    assert len(held_docs) > 100 and len(docs) > 10 * len(held_docs) // 2
    assert not set(docs) & set(held_docs) and all(len(d) >= 200 for d in docs + held_docs)
    passages, held_passages = reference_passages(held_out=False), reference_passages(held_out=True)
    assert passages and held_passages and not set(passages) & set(held_passages)
    assert all(len(p) <= 2000 for p in passages + held_passages)
