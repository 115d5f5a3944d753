"""The verification rules keep the target's distribution exactly: chi-square tests over 200,000
draws of two tokens, with the distributions of two tiny models of eight tokens (a target and a
draft from another seed) under temperature, top-k, top-p and min-p, and a control that must
fail: guesses accepted without the rejection step."""

import pytest
import torch

from worker import SamplingParams
from worker.noise import exponential
from worker.runner.sampler import Sampler, SamplingRow
from worker.spec.verify import accept_matching, normalized, rejection_sample

VOCAB = 8
DRAWS = 200_000
PARAMS = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02)


def _tiny_lm(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3)).eval()


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After a fixed context: the first token's distribution [V], the second's given the
    first [V, V], the third's given both [V, V, V], under PARAMS."""
    model = _tiny_lm(seed)
    context = [3, 1, 4, 1, 5]
    seqs = torch.tensor([context + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.no_grad():
        logits = model(seqs).logits[:, -3:].float()  # [V * V, 3, V]
    rows = [SamplingRow(PARAMS, None)] * (VOCAB * VOCAB)
    sampler = Sampler(0)
    p = [normalized(sampler.probs(logits[:, i], rows)) for i in range(3)]
    return p[0][0], p[1].view(VOCAB, VOCAB, VOCAB)[:, 0], p[2].view(VOCAB, VOCAB, VOCAB)


@pytest.fixture(scope="module")
def models():
    return _distributions(seed=1), _distributions(seed=2)  # target, draft


def _race(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return (probs / exponential(probs.shape, g)).argmax(dim=-1)


def _two_tokens(target, kept, after, guesses, g):
    """The first two tokens emitted: the guesses kept, the token after them, and when only
    the first was decided this step the second drawn from the target, as the next step would."""
    p1, p2, _ = target
    first = torch.where(kept >= 1, guesses[:, 0], after)
    second = torch.where(kept >= 2, guesses[:, 1], torch.where(kept == 1, after, _race(p2[first], g)))
    return first, second


def _p_value(first, second, target) -> float:
    """Chi-square goodness of fit of the pairs against p1(a) p2(b | a), over cells expecting >= 5."""
    p1, p2, _ = target
    expected = (p1[:, None] * p2).flatten() * len(first)
    observed = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double()
    keep = expected >= 5
    assert observed[~keep].sum() <= 5 * (~keep).sum() + 10  # the cells too rare to test stay rare
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _draft_guesses(draft, g):
    q1, q2, _ = draft
    g1 = _race(q1.expand(DRAWS, VOCAB), g)
    g2 = _race(q2[g1], g)
    return torch.stack([g1, g2], dim=1), torch.stack([q1.expand(DRAWS, VOCAB), q2[g1]], dim=1)


def _target_rows(target, guesses):
    p1, p2, p3 = target
    return torch.stack([p1.expand(DRAWS, VOCAB), p2[guesses[:, 0]], p3[guesses[:, 0], guesses[:, 1]]], dim=1)


def _rejection_p_value(models, accept_all: bool) -> float:
    target, draft = models
    g = torch.Generator().manual_seed(0)
    guesses, q = _draft_guesses(draft, g)
    uniforms = torch.rand(DRAWS, 2, generator=g)
    if accept_all:  # the broken verifier: every guess kept
        uniforms = torch.zeros_like(uniforms)
    noise = exponential((DRAWS, VOCAB), g)
    kept, after = rejection_sample(_target_rows(target, guesses), q, guesses, uniforms, noise)
    if not accept_all:  # every outcome occurred: none, one or both guesses kept
        assert (torch.bincount(kept, minlength=3) > DRAWS // 20).all()
    return _p_value(*_two_tokens(target, kept, after, guesses, g), target)


def test_rejection_sampling_keeps_the_targets_distribution(models):
    p = _rejection_p_value(models, accept_all=False)
    print(f"rejection sampling, draft distributions: chi-square p = {p:.3f}")
    assert p > 1e-3


def test_accepting_draft_guesses_without_rejection_fails_the_same_test(models):
    p = _rejection_p_value(models, accept_all=True)
    print(f"plain acceptance: chi-square p = {p:.3g}")
    assert p < 1e-9


def test_point_guesses_verified_by_the_targets_own_draws_keep_its_distribution(models):
    target, draft = models
    g = torch.Generator().manual_seed(1)
    q1, q2, _ = draft
    g1 = q1.argmax().expand(DRAWS)  # a greedy draft: the same guesses every time
    guesses = torch.stack([g1, q2[g1].argmax(dim=-1)], dim=1)
    targets = _race(_target_rows(target, guesses), g)
    kept, after = accept_matching(targets, guesses)
    p = _p_value(*_two_tokens(target, kept, after, guesses, g), target)
    print(f"point guesses: chi-square p = {p:.3f}")
    assert p > 1e-3
    assert (kept > 0).float().mean() > 0.1  # the guesses were often kept: the test covered that branch
