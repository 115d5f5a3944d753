# mypy: disable-error-code="arg-type,dict-item,index,misc,operator"
"""Train an EAGLE head (``eagle_head.py``) for a Llama-family model on this machine:

    python -m control_plane.tools.train_eagle --model smollm2-135m --out DIR

1. texts from the Python standard library (``eagle_data.py``): docstrings as prompts the
   target answers through Kervan's engine (greedy and sampled), and more docstrings and the
   language reference read by it; the target's hidden states at every position;
2. the head learns, teacher-forced, to predict the next hidden state (smooth L1) and the
   target's own distribution of the token after it (cross-entropy against the target's
   LM head on that hidden state, over the draft vocabulary: self-distillation, so every
   position read or written teaches the target's choice), with uniform noise on its input
   features (EAGLE's robustness to its own errors);
3. DIR gets ``eagle_head.safetensors`` (bf16) and ``eagle_head.json``: sizes, data and
   token counts, held-out accuracy (the head's top-1 against the target's greedy choice on
   held-out answers), the arguments and the seed. Same machine kind, same arguments: the
   same numbers (the engine and training are seeded).

Needs ``transformers`` (``pip install 'kervan[pull]'``): its Llama layer is the training
module, which Kervan's own layer reproduces when serving (tested)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from control_plane.tools.eagle_data import Example
from worker.spec.eagle_head import CONFIG_FILE, WEIGHTS_FILE

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
FEATURE_NOISE = 0.1  # uniform noise on input features, relative to their RMS
TOKEN_LOSS_WEIGHT = 1.0  # the distillation term against the regression's 1
READ_MIN_CHARS = 80  # shorter docstrings than those answered are still worth reading


class TrainingHead(nn.Module):
    """The head as a plain autograd module: the target's embedding and LM head frozen
    (``lm_head`` [vocab, hidden]: the whole of it, for the target's own choices; the head
    guesses over the rows of ``vocab``)."""

    def __init__(self, model_dir: Path, intermediate_size: int, embed: torch.Tensor, lm_head: torch.Tensor,
                 vocab: torch.Tensor):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config = AutoConfig.from_pretrained(model_dir)
        if config.architectures[0] not in LLAMA_FAMILY:
            raise SystemExit(f"train_eagle: {config.architectures[0]} is not a Llama-family model")
        config.num_hidden_layers, config.intermediate_size, config.attention_bias = 1, intermediate_size, False
        config.mlp_bias, config._attn_implementation = False, "sdpa"
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head", lm_head)
        self.register_buffer("lm_rows", lm_head[vocab])
        self.register_buffer("vocab", vocab)
        self.register_buffer("column", torch.full((len(lm_head),), -1, dtype=torch.long))  # target id -> draft column
        self.column[vocab] = torch.arange(len(vocab))
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, next_tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed[next_tokens], features], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        x = self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.norm(x[0] if isinstance(x, tuple) else x)

    def kervan_tensors(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight}
        out.update({f"layers.0.{name}": t for name, t in self.layer.state_dict().items()})
        out = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in out.items()}
        return {**out, "vocab": self.vocab.to(torch.int32)}


def draft_vocabulary(examples: list[Example], size: int) -> torch.Tensor:
    """The ``size`` tokens most frequent after the first in the examples, ties to the smaller id; ascending."""
    counts = Counter(t for ex in examples for t in ex.token_ids[1:])
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return torch.tensor(sorted(t for t, _ in top), dtype=torch.long)


def batches(examples: list[Example], batch_tokens: int, generator: torch.Generator):
    """Padded training batches, similar lengths together, in a seeded order: (next tokens,
    features, target features, positions with data, positions of the target's answers)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].token_ids))
    groups, group = [], []
    for i in order:
        group.append(i)
        if len(group) * len(examples[i].token_ids) >= batch_tokens:
            groups.append(group)
            group = []
    groups += [group] if group else []
    for g in torch.randperm(len(groups), generator=generator).tolist():
        yield _pad([examples[i] for i in groups[g]])


def _pad(examples: list[Example]):
    length = max(len(ex.token_ids) for ex in examples) - 2
    hidden = examples[0].hidden.shape[1]
    out = (torch.zeros(len(examples), length, dtype=torch.long), torch.zeros(len(examples), length, hidden),
           torch.zeros(len(examples), length, hidden), torch.zeros(len(examples), length, dtype=torch.bool),
           torch.zeros(len(examples), length, dtype=torch.bool))
    for b, ex in enumerate(examples):
        n = len(ex.token_ids) - 2  # input i: (x[i + 1], f[i]); targets f[i + 1] and the target's choice from it
        out[0][b, :n] = torch.tensor(ex.token_ids[1:n + 1])
        out[1][b, :n] = ex.hidden[:n].float()
        out[2][b, :n] = ex.hidden[1:n + 1].float()
        out[3][b, :n] = True
        out[4][b, max(0, ex.num_prompt_tokens - 2):n] = True
    return out


def evaluate(head: TrainingHead, examples: list[Example]) -> float:
    """Teacher-forced: how often the head's top guess is the target's greedy choice, on
    the target's answers (a choice outside the draft vocabulary counts as missed)."""
    right = total = 0
    with torch.no_grad():
        for tokens, feats, target_feats, _, answer in batches(examples, 8192, torch.Generator().manual_seed(0)):
            guess = (head(tokens, feats)[answer] @ head.lm_rows.T).argmax(dim=-1)
            choice = head.column[(target_feats[answer] @ head.lm_head.T).argmax(dim=-1)]
            right += int((guess == choice).sum())
            total += int(answer.sum())
    return right / max(total, 1)


def train(head: TrainingHead, examples: list[Example], epochs: int, lr: float, batch_tokens: int, seed: int,
          say=print) -> None:
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * sum(1 for _ in batches(examples, batch_tokens, torch.Generator().manual_seed(0)))
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(s / total, 1.0)))))
    for epoch in range(epochs):
        seen, loss_sum = 0, 0.0
        for tokens, feats, target_feats, mask, _ in batches(examples, batch_tokens, generator):
            scale = feats.pow(2).mean().sqrt()
            noisy = feats + (torch.rand(feats.shape, generator=generator) - 0.5) * 2 * FEATURE_NOISE * scale
            predicted, wanted = head(tokens, noisy)[mask], target_feats[mask]
            regression = nn.functional.smooth_l1_loss(predicted, wanted)
            choice = torch.softmax(wanted @ head.lm_rows.T, dim=-1)  # the target's, over the draft vocabulary
            loss = regression + TOKEN_LOSS_WEIGHT * nn.functional.cross_entropy(predicted @ head.lm_rows.T, choice)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            seen, loss_sum = seen + 1, loss_sum + loss.item()
        say(f"epoch {epoch + 1}/{epochs}: loss {loss_sum / max(seen, 1):.4f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m control_plane.tools.train_eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a catalog name (kervan pull) or a model directory")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompts", type=int, default=1200, help="training prompts (docstrings) answered by the target")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    ap.add_argument("--no-read", dest="read", action="store_false",
                    help="train on the answers only, not on the other docstrings and the language reference")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=4096, help="the draft vocabulary: the target's most used tokens")
    ap.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    head, meta = build_head(args)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(head.pop("tensors"), str(args.out / WEIGHTS_FILE))
    meta["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out} in {meta['seconds']} s: held-out accuracy {meta['held_out_accuracy']:.3f}")


def build_head(args: argparse.Namespace) -> tuple[dict, dict]:
    from control_plane.tools.eagle_data import chat_prompts, generate_examples, reference_passages, stdlib_docstrings
    from control_plane.tools.pull import resolve_model
    from worker import Engine

    model_dir = resolve_model(args.model)
    engine = Engine.from_pretrained(model_dir, enable_prefix_caching=False, max_num_seqs=32, seed=args.seed)
    docs, held_docs = stdlib_docstrings(held_out=False), stdlib_docstrings(held_out=True)
    step = max(1, len(docs) // args.prompts)  # spread over the library, not its first files
    answered, held_docs = docs[::step][:args.prompts], held_docs[:max(32, args.prompts // 10)]
    taken = set(answered)
    read = [doc for doc in stdlib_docstrings(held_out=False, min_chars=READ_MIN_CHARS) if doc not in taken]
    read += reference_passages(held_out=False)
    print(f"{len(answered)} docstrings to answer, {len(read)} texts to read, {len(held_docs)} held out",
          file=sys.stderr)
    answers = generate_examples(engine, chat_prompts(answered, model_dir), args.max_tokens, args.seed)
    readings = generate_examples(engine, read, 1, args.seed) if args.read else []
    held_set = generate_examples(engine, chat_prompts(held_docs, model_dir), args.max_tokens, args.seed + 10**6)
    train_set = answers + readings
    cfg = engine.model_config
    vocab = draft_vocabulary(train_set, args.draft_vocab)
    with torch.no_grad():
        embed = engine.runner.model.embed(torch.arange(cfg.vocab_size)).float()
        eye = torch.eye(cfg.hidden_size, dtype=engine.config.dtype)
        lm_head = engine.runner.model.compute_logits(eye).T.float().contiguous()
    intermediate = args.intermediate_size or cfg.intermediate_size
    head = TrainingHead(model_dir, intermediate, embed, lm_head, vocab)
    print(f"training on {sum(len(ex.token_ids) - 2 for ex in train_set)} positions", file=sys.stderr)
    train(head, train_set, args.epochs, args.lr, args.batch_tokens, args.seed,
          say=lambda line: print(line, file=sys.stderr))
    emitted = [t for ex in held_set for t in ex.token_ids[ex.num_prompt_tokens:]]
    meta = {
        "hidden_size": cfg.hidden_size, "target_vocab_size": cfg.vocab_size, "intermediate_size": intermediate,
        "draft_vocab_size": len(vocab), "target": str(args.model),
        "data": {"texts": f"the Python {platform.python_version()} standard library's docstrings and language "
                          f"reference (pydoc_data.topics)",
                 "answered_prompts": len(answers), "read_texts": len(readings), "held_out_prompts": len(held_set),
                 "prompt_tokens": sum(ex.num_prompt_tokens for ex in answers),
                 "generated_tokens": sum(len(ex.token_ids) - ex.num_prompt_tokens for ex in answers),
                 "read_tokens": sum(ex.num_prompt_tokens for ex in readings)},
        "held_out_accuracy": evaluate(head, held_set),
        "held_out_vocab_coverage": sum(int(head.column[t] >= 0) for t in emitted) / max(len(emitted), 1),
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
    }
    engine.close()
    return {"tensors": head.kervan_tensors()}, meta


if __name__ == "__main__":
    main()
