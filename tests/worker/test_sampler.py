"""The sampler's filters and draws, and its greedy argmax, on hand-made logits."""

import math

import pytest
import torch

from worker import SamplingParams
from worker.noise import exponential
from worker.runner.sampler import Sampler, SamplingRow, argmax

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def draw(params, trials=4000, logits=LOGITS):
    sampler = Sampler(seed=0)
    rows = [SamplingRow(params, None)] * trials
    tokens, _ = sampler(logits.expand(trials, -1).clone(), rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[1]).float() / trials


def test_plain_sampling_follows_the_distribution():
    freq = draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, LOGITS.exp()[0], atol=0.03)


def test_top_k_keeps_the_k_best():
    freq = draw(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    assert math.isclose(freq[0].item(), 2 / 3, abs_tol=0.03)


def test_top_p_keeps_the_smallest_set_covering_p():
    freq = draw(SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 covers 0.7
    assert freq[2:].sum() == 0 and freq[1] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    freq = draw(SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert freq[3:].sum() == 0 and freq[2] > 0


def test_low_temperature_sharpens():
    freq = draw(SamplingParams(temperature=0.1))
    assert freq[0] > 0.99


def test_greedy_and_sampled_rows_mix_in_one_batch():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0), None), SamplingRow(SamplingParams(temperature=1), None)]
    tokens, logprobs = sampler(logits, rows)
    assert tokens[0] == 1 and logprobs is None


def test_seeded_row_ignores_its_neighbours():
    seeded = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    alone = Sampler(0)(logits.clone(), [SamplingRow(seeded, torch.Generator().manual_seed(7))])[0]
    batch = torch.cat([torch.randn(3, 50), logits])
    rows = [SamplingRow(SamplingParams(temperature=1.0), None)] * 3 + [
        SamplingRow(seeded, torch.Generator().manual_seed(7))]
    assert Sampler(1)(batch, rows)[0][3] == alone[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_argmax_is_torchs_on_logits_in_the_model_dtype(dtype):
    """The native kernel (where loaded) reads logits as they are: the first index of the
    largest value, a NaN counting as largest, for any vocabulary length."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 49159, generator=gen) * 4).to(dtype)
    logits[1, 100] = logits[1, 40_000] = logits[1].max() + 1  # a tie: the first wins
    logits[2, 7] = logits[2, 30_000] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = float("inf")
    logits[5, :3] = logits[5].max() + 1
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == argmax(logits.float()).tolist()
    assert argmax(logits)[1] == 100 and argmax(logits)[2] == 7 and argmax(logits)[4] == 49158
    assert argmax(logits[:, :5]).tolist() == logits[:, :5].argmax(dim=-1).tolist()  # shorter than a vector
    greedy = SamplingParams(temperature=0, logprobs=True)
    tokens, logprobs = Sampler(seed=0)(logits[[0, 1, 6]], [SamplingRow(greedy, None)] * 3)
    want = torch.log_softmax(logits[[0, 1, 6]].float(), dim=-1)
    assert logprobs == [want[i, t].item() for i, t in enumerate(tokens)]


def test_the_race_noise_is_exponential_never_zero_and_follows_its_generator():
    g = torch.Generator().manual_seed(5)
    e = exponential((1_000_000,), g).double()
    assert (e > 0).all() and abs(e.mean() - 1) < 0.005 and abs(e.var() - 1) < 0.02
    assert abs((e > 2).double().mean() - math.exp(-2)) < 0.002  # the tail: P(E > 2) = e^-2
    again = exponential((1_000_000,), torch.Generator().manual_seed(5)).double()
    assert torch.equal(e, again)
