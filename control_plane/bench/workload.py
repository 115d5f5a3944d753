# mypy: disable-error-code="union-attr"
"""What a benchmark sends: a seeded list of requests.

Prompts are token ids (a Kervan router takes them as they are; an OpenAI server
takes a list of ids as ``prompt``), or text from a file of real prompts. Lengths
come from a distribution written ``fixed:N``, ``uniform:LO:HI`` or
``normal:MEAN:STD`` (clipped at 1). A shared-prefix workload puts one of
``groups`` fixed prefixes before every prompt, group k chosen with probability
proportional to 1/k^s (Zipf): a few system prompts are hot, many are cold, as in
production chat traffic."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    max_tokens: int
    prefix_group: int = -1  # the shared prefix it starts with; -1: none

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass(frozen=True)
class Lengths:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                spec = cls("fixed", int(parts[1]))
            elif parts[0] in ("uniform", "normal") and len(parts) == 3:
                spec = cls(parts[0], float(parts[1]), float(parts[2]))
            elif len(parts) == 1:
                spec = cls("fixed", int(parts[0]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"length {text!r}: expected N, fixed:N, uniform:LO:HI or normal:MEAN:STD") from None
        if spec.a < 1 or (spec.kind == "uniform" and spec.b < spec.a) or spec.b < 0:
            raise ValueError(f"length {text!r}: lengths are at least 1 and LO <= HI")
        return spec

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    @property
    def cv2(self) -> float:
        """The squared coefficient of variation of a draw (variance over the mean squared)."""
        spread = {"uniform": (self.b - self.a) ** 2 / 12, "normal": self.b ** 2}.get(self.kind, 0.0)
        return spread / self.mean ** 2

    @property
    def upper(self) -> int:
        """The longest a draw is (normal: three deviations above the mean)."""
        return int(self.b if self.kind == "uniform" else self.a + 3 * self.b if self.kind == "normal" else self.a)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


@dataclass(frozen=True)
class SharedPrefix:
    groups: int
    length: int
    zipf_s: float = 1.1

    @classmethod
    def parse(cls, text: str) -> SharedPrefix:
        try:
            groups, length, *s = text.split(":")
            spec = cls(int(groups), int(length), float(s[0]) if s else 1.1)
        except ValueError:
            raise ValueError(f"shared prefix {text!r}: expected GROUPS:LENGTH[:ZIPF_S]") from None
        if spec.groups < 1 or spec.length < 1 or spec.zipf_s < 0:
            raise ValueError(f"shared prefix {text!r}: at least one group of at least one token, s >= 0")
        return spec

    def weights(self) -> list[float]:
        return [1.0 / (k + 1) ** self.zipf_s for k in range(self.groups)]


def build(num: int, input_len: Lengths, output_len: Lengths, seed: int = 0, token_range: tuple[int, int] = (3, 600),
          shared_prefix: SharedPrefix | None = None, prompts_file: Path | None = None,
          prefix_seed: int | None = None) -> list[BenchRequest]:
    """``num`` requests. With ``prompts_file`` the prompts are its texts (taken in a seeded
    order, repeated if there are fewer) and ``input_len`` is ignored; with ``shared_prefix``
    ``input_len`` is the part after the prefix. The prefixes come from ``prefix_seed``
    (default ``seed``): lists built with other seeds share them, as one server's traffic
    shares its system prompts."""
    rng = random.Random(seed)
    lo, hi = token_range
    if prompts_file is not None:
        texts = read_prompts(prompts_file)
        order = [texts[i % len(texts)] for i in range(num)]
        rng.shuffle(order)
        return [BenchRequest(t, output_len.draw(rng)) for t in order]
    prefixes = []
    if shared_prefix is not None:
        prefix_rng = random.Random(f"{seed if prefix_seed is None else prefix_seed}-prefixes")
        prefixes = [[prefix_rng.randrange(lo, hi) for _ in range(shared_prefix.length)]
                    for _ in range(shared_prefix.groups)]
    out = []
    for _ in range(num):
        group = rng.choices(range(len(prefixes)), weights=shared_prefix.weights())[0] if prefixes else -1
        body = [rng.randrange(lo, hi) for _ in range(input_len.draw(rng))]
        out.append(BenchRequest((prefixes[group] if prefixes else []) + body, output_len.draw(rng), group))
    return out


def read_prompts(path: Path) -> list[str]:
    """A file of real prompts: JSON lines with a "prompt" (or "text") field, or plain
    text with one prompt per line."""
    texts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{n}: a JSON line needs a "prompt" or "text" string')
            texts.append(text)
        else:
            texts.append(line)
    if not texts:
        raise ValueError(f"{path}: no prompts")
    return texts
