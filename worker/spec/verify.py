"""Verifying speculative guesses: which of a sequence's k guesses the target keeps, and the
token that follows them. Both rules leave the output distribution exactly the target's.

A step runs the target on ``[last, g1 .. gk]`` and gets its distributions ``p0 .. pk``
(``pi`` follows ``gi``). Then:

- **Point guesses** (n-gram, greedy drafts; and every greedy request): the target draws
  its token ``ti`` from each ``pi`` exactly as a step without speculation would (argmax,
  or the exponential race with the sample's own noise), and keeps the guesses up to the
  first ``g(i+1) != ti``; it emits ``t0 .. ta``. Each emitted token is the target's own
  draw given the tokens before it, so a seeded request gives the same tokens with and
  without speculation. For a guess ``g`` this accepts with probability ``p(g)`` and
  otherwise draws from ``p`` without ``g``: rejection sampling with a one-hot draft.
- **Draft distributions** (a draft that sampled ``gi`` from its own ``qi``): rejection
  sampling (Leviathan et al. 2023; Chen et al. 2023): keep ``gi`` with probability
  ``min(1, pi(gi) / qi(gi))``; at the first rejection draw from ``max(0, pi - qi)``
  normalized; when all are kept draw a bonus token from ``pk``.

``p`` and ``q`` are the distributions after the request's temperature, top-k, top-p and
min-p (``Sampler.probs``), on both sides. The functions take batches, so a test can draw
from them a hundred thousand times at once."""

from __future__ import annotations

import torch


def accept_matching(targets: torch.Tensor, guesses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Point guesses: ``targets`` [B, k + 1], the target's token at each position,
    ``guesses`` [B, k]. Returns (guesses kept [B], the token after them [B])."""
    kept = (targets[:, :-1] == guesses).int().cumprod(dim=1).sum(dim=1)
    return kept, targets.gather(1, kept[:, None].long()).squeeze(1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, guesses: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft distributions: ``p`` [B, k + 1, V] the target's, ``q`` [B, k, V] the draft's,
    both normalized; ``guesses`` [B, k] drawn from ``q``; ``uniforms`` [B, k] in [0, 1);
    ``noise``: Exponential(1), [B, V] for the one draw after the guesses kept, or a callable
    ``kept -> [B, V]`` that draws it then. Returns (guesses kept [B], the token after them [B])."""
    batch, k = guesses.shape
    index = guesses[..., None].long()
    p_guess = p[:, :k].gather(2, index).squeeze(2)
    q_guess = q.gather(2, index).squeeze(2)
    # u < p / q, without the division (q(g) > 0: g was drawn from q)
    kept = (uniforms * q_guess < p_guess).int().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch)
    p_next = p[rows, kept]
    # after the last guess q is zero: the residual is p itself, the bonus token's distribution
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, kept]
    residual = (p_next - q_next).clamp_min(0)
    return kept, (residual / (noise(kept) if callable(noise) else noise)).argmax(dim=-1)


def normalized(probs: torch.Tensor) -> torch.Tensor:
    """Rows summing to one (``Sampler.probs`` leaves min-p's cut rows as they are)."""
    return probs / probs.sum(dim=-1, keepdim=True)
