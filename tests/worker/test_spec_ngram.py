"""Prompt lookup proposals against a brute-force reading of the rule: the latest earlier
occurrence of the longest suffix n-gram, what followed it, at most k tokens."""

import random

import pytest

from worker.spec.ngram import NgramProposer


def brute_force(tokens, k, min_n, max_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_the_continuation_of_a_repeated_phrase_is_proposed():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert NgramProposer(3).propose(text) == [8, 9, 1]
    assert NgramProposer(10).propose(text) == [8, 9, 1, 2, 5, 6, 7]  # runs to the context's end, no further


def test_the_longest_suffix_match_wins_then_the_latest_occurrence():
    # "7" alone last appeared before 4; "6 7" appeared before 3, so n = 2 decides
    text = [6, 7, 3, 1, 7, 4, 2, 6, 7]
    assert NgramProposer(1, max_n=2).propose(text) == [3]
    assert NgramProposer(1, max_n=1).propose(text) == [4]
    assert NgramProposer(2).propose([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1]  # the latest of two occurrences


def test_nothing_is_proposed_without_an_earlier_occurrence():
    assert NgramProposer(4).propose([1, 2, 3, 4]) == []
    assert NgramProposer(4).propose([7]) == []
    assert NgramProposer(4).propose([]) == []
    assert NgramProposer(4, min_n=2).propose([3, 1, 2, 3]) == []  # only a 1-gram repeats


@pytest.mark.parametrize("seed", range(20))
def test_random_contexts_match_the_brute_force_rule(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
    k, min_n = rng.randrange(1, 6), rng.randrange(1, 3)
    max_n = min_n + rng.randrange(0, 4)
    assert NgramProposer(k, min_n, max_n).propose(tokens) == brute_force(tokens, k, min_n, max_n)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(2, min_n=3, max_n=2)
