"""Training data for an EAGLE head: text every machine has, read by the target, and the
target's own continuations of prompts made from it, with the target's hidden states at
every position (the numbers the head reads when serving, recorded as Kervan's engine
computes them).

Texts: the docstrings of the Python standard library's own sources (modules, classes and
functions, read with ``ast`` — nothing is imported), split into training and held-out
texts by the file they come from; and the Python language reference's topics as
``help()`` shows them (``pydoc_data.topics``), split by topic. Prompts: one of a few
instructions and a docstring as a chat message (the model's chat template), or the
docstring alone to continue. Answers: the target's greedy and sampled (T = 0.8)
continuations. Texts only read (``max_tokens=1``) cost a prefill each: many more
positions for the same time, on text the target did not write."""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from kervan.sampling import SamplingParams
from worker.batch import ScheduledSequence
from worker.engine.outputs import RequestOutput

INSTRUCTIONS = ("Explain what this documentation describes.", "Summarize this in two sentences.",
                "Write a short Python example that uses this.", "What are the main points here?")
MIN_DOC_CHARS = 200
MAX_DOC_CHARS = 700


def stdlib_docstrings(held_out: bool, min_chars: int = MIN_DOC_CHARS) -> list[str]:
    """Docstrings of the standard library's .py files (tests and idlelib left out), in a
    fixed order; a file is held out when the first byte of its path's SHA-256 is < 26 (~10%),
    and a text a held-out file also holds is held out."""
    return _kept_apart(held_out, lambda held: _file_docstrings(held, min_chars))


def _kept_apart(held_out: bool, texts) -> list[str]:
    """``texts(held_out)``, less any held-out text when training (the standard library
    holds some texts twice, in files or topics on both sides)."""
    if held_out:
        return texts(True)
    held = set(texts(True))
    return [text for text in texts(False) if text not in held]


def _file_docstrings(held_out: bool, min_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test/", "idlelib/", "site-packages/", "lib2to3/tests")) or "/tests/" in rel:
            continue
        if _held_out(rel) != held_out:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append(doc[:MAX_DOC_CHARS])
    return list(dict.fromkeys(docs))  # the same text twice (inherited docs) once


def _held_out(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] < 26  # about 10%


def reference_passages(held_out: bool, max_chars: int = 2000) -> list[str]:
    """The language reference's topics in passages of at most ``max_chars`` (cut at blank
    lines), in a fixed order; a topic is held out as a docstring's file is."""
    return _kept_apart(held_out, lambda held: _topic_passages(held, max_chars))


def _topic_passages(held_out: bool, max_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        if _held_out(name) != held_out:
            continue
        passage = ""
        for paragraph in topics[name].split("\n\n"):
            if passage and len(passage) + len(paragraph) > max_chars:
                passages.append(passage)
                passage = ""
            passage = f"{passage}\n\n{paragraph}" if passage else paragraph[:max_chars]
        passages += [passage] if len(passage) >= MIN_DOC_CHARS else []
    return passages


def chat_prompts(docs: list[str], model_dir: str | Path) -> list[str]:
    """Each docstring as a chat request (an instruction from ``INSTRUCTIONS`` in turn), every
    fifth as plain text to continue."""
    from kervan.chat_template import ChatTemplate  # the router's renderer, in the shared vocabulary

    template = ChatTemplate.from_dir(model_dir)
    prompts = []
    for i, doc in enumerate(docs):
        if i % 5 == 4:
            prompts.append(doc)
        else:
            message = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{doc}"
            prompts.append(template.render([{"role": "user", "content": message}]))
    return prompts


@dataclass
class Example:
    token_ids: list[int]  # prompt, then the target's continuation
    num_prompt_tokens: int
    hidden: torch.Tensor  # [len(token_ids) - 1, hidden]: the target's final hidden state at each computed position


class HiddenRecorder:
    """A proposer that guesses nothing and keeps each sequence's hidden states."""

    reads_hidden = True

    def __init__(self):
        self.rows: dict[str, list[torch.Tensor]] = {}

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[str, torch.Tensor]) -> None:
        for s in scheduled:
            rows = hidden.get(s.sequence.seq_id)
            if rows is not None:
                self.rows.setdefault(s.sequence.seq_id, []).append(rows.clone())

    def propose(self, running) -> None:
        pass

    def close(self) -> None:
        pass


def generate_examples(engine, prompts: list[str], max_tokens: int, seed: int = 0) -> list[Example]:
    """The target's continuation of each prompt (even ones greedy, odd ones sampled at T = 0.8
    with their own seed), with its hidden states. The engine must not cache prefixes (every
    position is computed, so every hidden state recorded)."""
    if engine.config.enable_prefix_caching:
        raise ValueError("record hidden states with enable_prefix_caching=False")
    recorder = HiddenRecorder()
    engine.proposer, engine.runner.keep_hidden = recorder, True
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False) if i % 2 == 0 else
              SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=False)
              for i in range(len(prompts))]
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    examples = []
    for rid in ids:
        out = final[rid]
        tokens = out.prompt_token_ids + out.token_ids
        hidden = torch.cat(recorder.rows.pop(rid))
        if len(hidden) != len(tokens) - 1:  # a preempted sequence computes positions twice
            raise RuntimeError(f"{len(hidden)} hidden states for {len(tokens) - 1} positions: give the engine more "
                               f"KV blocks, or fewer sequences at once")
        examples.append(Example(tokens, len(out.prompt_token_ids), hidden))
    engine.proposer, engine.runner.keep_hidden = None, False
    return examples
