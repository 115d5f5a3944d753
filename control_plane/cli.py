"""The ``kervan`` command line.

``kervan complete`` runs the engine in this process on a model directory (the
embedded default model when none is given) and prints the completion; the
cluster commands (``up``, ``generate`` against a router) come with the mesh."""

from __future__ import annotations

import json
import sys
import time

import click


@click.group()
def main() -> None:
    """Kervan: serve large language models across many processes and machines."""


@main.command()
@click.argument("prompt")
@click.option("--model", "model_dir", default=None, help="Hugging Face model directory (default: embedded model).")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--temperature", default=0.8, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--min-p", default=0.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("-n", "n", default=1, show_default=True, help="Number of samples.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def complete(prompt: str, model_dir: str | None, max_tokens: int, temperature: float, top_p: float,
             top_k: int, min_p: float, seed: int | None, n: int, ignore_eos: bool, dtype: str,
             as_json: bool) -> None:
    """Complete PROMPT with the in-process engine."""
    from worker import Engine, InvalidRequest, SamplingParams
    from worker.default_model import ensure_default_model

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=seed, n=n, ignore_eos=ignore_eos)
        engine = Engine.from_pretrained(model_dir or ensure_default_model(), dtype=dtype)
        start = time.perf_counter()
        [out] = engine.generate([prompt], params)
    except (InvalidRequest, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    elapsed = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({
            "prompt_tokens": len(out.prompt_token_ids),
            "completions": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in out.outputs],
            "seconds": round(elapsed, 3)}))
        return
    for c in out.outputs:
        click.echo(f"{prompt}{c.text}")
    total = sum(len(c.token_ids) for c in out.outputs)
    click.echo(f"[{total} tokens in {elapsed:.2f}s, finish: {', '.join(c.finish_reason for c in out.outputs)}]",
               err=True)


if __name__ == "__main__":
    sys.exit(main())
