"""Token sampling for a batch of rows, each with its own parameters.

Order per row: temperature, top-k, top-p, min-p, then a draw. Greedy rows take
the argmax. Sampled rows use the exponential race, ``argmax(p / E)`` with
``E ~ Exponential(1)``, which draws from ``p`` exactly and is far cheaper than
``torch.multinomial`` on the CPU (``E = -log U``: 4x cheaper there than
``Tensor.exponential_``). A seeded row draws ``E`` from its own generator,
so its tokens do not depend on what else is in the batch. Log-probabilities are
those of the chosen tokens under the model's raw distribution (before
temperature and filtering), as vLLM reports by default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kervan.sampling import SamplingParams
from worker.kernels import has_native_kernels
from worker.noise import exponential


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    # a seeded row's noise drawn ahead from its generator (``Sequence.take_noise``): used as it is
    noise: torch.Tensor | None = None


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance a seeded row's generator past one token's draw, as ``Sampler`` makes it
    (a continuation of a request whose earlier tokens were drawn elsewhere)."""
    exponential((vocab_size,), generator)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN counting as largest), as
    ``Tensor.argmax``: the native kernel reads bf16 logits as they are, in one pass."""
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.shape[-1] and has_native_kernels():
        return torch.ops.kervan.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float] | None]:
        # logits: [num_rows, vocab] in the model's dtype (greedy rows compare them as they are)
        want_logprobs = any(r.params.logprobs for r in rows)
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            tokens = argmax(logits)
        else:
            logits = logits.float()
            tokens = self._sample(logits, rows, torch.tensor(greedy))
        logprobs = None
        if want_logprobs:
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: torch.Tensor) -> torch.Tensor:
        probs = self.probs(logits, rows)
        noise = self.noise(probs.shape, rows)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def noise(self, shape: torch.Size, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential(1) noise for each row: a seeded row's from its own stream, the rest from the engine's."""
        seeded = [i for i, r in enumerate(rows) if r.generator is not None or r.noise is not None]
        noise = exponential(shape, self.generator) if len(seeded) < len(rows) else torch.empty(shape)
        for i in seeded:
            row_noise, generator = rows[i].noise, rows[i].generator
            noise[i] = row_noise if row_noise is not None else exponential(shape[1:], _seeded(generator))
        return noise

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's distribution after its temperature, top-k, top-p and min-p (float32
        logits; rows cut by min-p are not renormalized)."""
        temps = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows])
        x = logits / temps[:, None]
        top_k = [r.params.top_k if r.params.top_k > 0 else 0 for r in rows]
        if any(top_k):
            k_max = min(max(top_k), x.shape[1])
            top = x.topk(k_max, dim=-1).values  # [rows, k_max], descending
            kth = top.gather(1, (torch.tensor(top_k).clamp(1, k_max) - 1)[:, None])
            kth[torch.tensor(top_k) == 0] = -float("inf")
            x = x.masked_fill(x < kth, -float("inf"))
        top_p = torch.tensor([r.params.top_p for r in rows])
        if (top_p < 1).any():
            sorted_x, order = x.sort(dim=-1, descending=True)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the tokens before it already cover top_p (the first always stays)
            drop_sorted = (cum - sorted_x.softmax(dim=-1)) >= top_p[:, None]
            x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), -float("inf"))
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows])
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs


def _seeded(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("a seeded row without its generator")
    return generator
