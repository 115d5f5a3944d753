"""The embedded default model: a small Llama with seeded random weights and a
byte-level BPE tokenizer trained locally on a few paragraphs shipped below, so
Kervan runs on a fresh machine with no model argument and no download.

It is written once into the cache folder (``KERVAN_CACHE_DIR``, default
``~/.cache/kervan``) as an ordinary Hugging Face directory (``config.json``,
``model.safetensors``, ``tokenizer.json``) and loaded like any other model. Its
output is fluent nonsense; it exists to exercise the whole system, not to talk."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kervan.default_model import NAME, default_model_dir, is_written

SEED = 1234

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 0,  # set to the trained tokenizer's size
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2

CORPUS = """\
A caravan crosses the desert by night, its camels tied nose to tail, each one
carrying a share of the load. No single animal could bear it all; together they
reach the far city. Large language models travel the same way across many cards
and many machines: replicas carry the traffic, layers and experts are split
between processes, and the memory of each conversation moves with it.
The router listens at the gate and speaks to every traveller. The scheduler
decides which worker takes which request, looking at who already remembers the
start of the story and who is least busy. Prefill workers read long prompts in
one breath; decode workers answer one word at a time, quickly, many at once.
Once upon a time there was a small model with a large ambition. It knew seven
hundred words and eight layers of thought, and every morning it woke up with
the same random dreams, seeded so that they would never change. The quick brown
fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of
black quartz, judge my vow. How vexingly quick daft zebras jump!
In the beginning was the token, and the token was hashed, sixteen to a block,
each block chained to the one before it, so that two travellers who began their
journey with the same words could share the same memories of it.
"""


def ensure_default_model() -> Path:
    """The default model's directory, written on first use (atomically)."""
    target = default_model_dir()
    if is_written(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{NAME}-"))
    try:
        write_model(tmp)
        os.rename(tmp, target)
    except OSError:
        if not is_written(target):  # not just another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_model(out: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    cfg = dict(CONFIG, vocab_size=tokenizer.get_vocab_size())  # every id decodes to text
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(random_weights(cfg, SEED), str(out / "model.safetensors"), metadata={"format": "pt"})
    out.chmod(0o755)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    return tok


def random_weights(cfg: dict, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Llama tensors in Hugging Face names, normal(0, std) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dtype = torch.bfloat16

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    out = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype),
           "lm_head.weight": normal(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    return out


if __name__ == "__main__":  # what ``kervan.default_model.default_model_written`` runs
    print(ensure_default_model())
