# mypy: disable-error-code="index,operator,union-attr"
"""An EAGLE draft head (Li et al. 2024): one decoder layer that reads the target's final
hidden state at a position and the embedding of the token after it, and predicts the
target's hidden state at the next position; the target's LM head turns that into the
next token's distribution. Drafting feeds the head its own predictions back (EAGLE's
autoregression over features).

    f(i)  = the target's final hidden state at position i (post norm)
    g(i)  = norm(layer(fc([embed(x(i+1)), f(i)])))   ~ f(i+1)
    logits of x(i+2) = lm_head(g(i))

The embedding is the target's own (shared, no copy). The LM head is the target's rows for
the head's draft vocabulary only (EAGLE-3's reduced vocabulary): the tokens the target
emits most often in the training data, so a guess costs a fraction of a full head's
matmul; guesses outside it are simply never made (verification stays exact).

On disk (``python -m control_plane.tools.train_eagle`` writes it): ``eagle_head.safetensors`` with
``fc.weight`` [hidden, 2 * hidden], the layer as Hugging Face Llama names it under
``layers.0.``, ``norm.weight`` and ``vocab`` (the target's id of each draft column), and
``eagle_head.json`` (its sizes, the target it was trained for, and the recipe)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker.config import ConfigError, ModelConfig
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.packing import pack_weights
from worker.layers.rotary import RotaryEmbedding
from worker.models.decoder import DecoderLayer, DecoderModel, variant_linears

WEIGHTS_FILE = "eagle_head.safetensors"
CONFIG_FILE = "eagle_head.json"


def head_config(target: ModelConfig, intermediate_size: int) -> ModelConfig:
    """The head's one layer: the target's attention and widths, a dense MLP of its own size."""
    return dataclasses.replace(target, num_layers=1, intermediate_size=intermediate_size, moe=None, moe_layers=())


class EagleHead(nn.Module):
    is_last_stage = True
    moes: list = []

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, embed: VocabParallelEmbedding,
                 draft_vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.embed = embed  # the target's
        hidden = cfg.hidden_size
        self.fc = MergedColumnParallelLinear(2 * hidden, [hidden], False, dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, RotaryEmbedding(cfg.rope, max_positions, dtype), dtype)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(draft_vocab_size, hidden, dtype)
        self.register_buffer("vocab", torch.zeros(draft_vocab_size, dtype=torch.long), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta,
                carried: torch.Tensor | None = None) -> torch.Tensor:
        """g for each row; ``carried``: the feature each row reads ([rows, hidden])."""
        x = self.fc.forward(torch.cat([self.embed(input_ids), carried.to(self.norm.weight.dtype)], dim=-1))
        x, residual = self.layers[0].forward(positions, x, None, kv_caches[0], meta)
        return self.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [rows, draft vocabulary]

    def routed_tokens_per_rank(self) -> tuple[int, ...]:
        return ()

    def loaders(self) -> dict:
        out = {"fc.weight": lambda t: self.fc.load(0, t), "norm.weight": lambda t: self.norm.weight.data.copy_(t),
               "vocab": lambda t: self.vocab.copy_(t)}
        out.update(self.layers[0].loaders("layers.0.", self.cfg))
        return out

    def linears(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, (MergedColumnParallelLinear, RowParallelLinear))]

    def batch_variant_layers(self) -> list[str]:
        return variant_linears(self, self.linears() + [self.lm_head])


def load_eagle_head(head_dir: str | Path, target: DecoderModel, dtype: torch.dtype, max_positions: int,
                    device: str) -> EagleHead:
    head_dir = Path(head_dir)
    try:
        meta = json.loads((head_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{head_dir} holds no EAGLE head ({CONFIG_FILE}: {exc})") from None
    if meta.get("hidden_size") != target.cfg.hidden_size or meta.get("target_vocab_size") != target.cfg.vocab_size:
        raise ConfigError(f"the EAGLE head in {head_dir} was trained for a model of hidden size "
                          f"{meta.get('hidden_size')} and {meta.get('target_vocab_size')} tokens, not this one "
                          f"({target.cfg.hidden_size}, {target.cfg.vocab_size})")
    if target.embed is None or target.lm_head is None:
        raise ConfigError("an EAGLE head needs the target's embedding and LM head in one process")
    cfg = head_config(target.cfg, meta["intermediate_size"])
    with torch.device(device):
        head = EagleHead(cfg, dtype, max_positions, target.embed, meta["draft_vocab_size"])
    loaders, missing = head.loaders(), set(head.loaders())
    with safe_open(str(head_dir / WEIGHTS_FILE), framework="pt") as f:
        for name in f.keys():
            if name not in loaders:
                raise ConfigError(f"unexpected tensor {name!r} in the EAGLE head {head_dir}")
            tensor = f.get_tensor(name)
            loaders[name](tensor if name == "vocab" else tensor.to(dtype))
            missing.discard(name)
    if missing:
        raise ConfigError(f"the EAGLE head in {head_dir} lacks {sorted(missing)[:3]}")
    if not bool(((head.vocab >= 0) & (head.vocab < target.cfg.vocab_size)).all()):
        raise ConfigError(f"the EAGLE head in {head_dir} names tokens outside the target's vocabulary")
    with torch.no_grad():  # the target's LM head rows of the draft vocabulary, read through the head itself
        eye = torch.eye(cfg.hidden_size, dtype=dtype, device=device)
        head.lm_head.weight.data.copy_(target.compute_logits(eye).T[head.vocab])
    pack_weights(head.linears() + [head.lm_head], dtype, torch.device(device).type)
    return head.eval()
