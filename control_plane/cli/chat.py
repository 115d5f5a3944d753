"""``kervan chat``: a conversation in the terminal with a running router. Each turn sends
the whole history through the served model's chat template (the router's prefix cache
keeps the earlier turns' KV, so a turn computes only its new tokens), streams the answer
as it comes, and prints a line of its usage. Ctrl-C during an answer stops that answer (the
request is cancelled, which aborts it on the workers and frees its KV) and keeps what came;
Ctrl-C at the prompt clears the line; Ctrl-D or /exit leaves; /reset forgets the history."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click
import grpc

from control_plane.cli.client import Completion, accumulate, build_request, stream
from kervan.chat_template import ChatTemplate
from kervan.envs import KERVAN_API_KEY, KERVAN_TLS_CA
from services.common.security import MeshSecurity

PROMPT = "you> "


@dataclass
class Conversation:
    template: ChatTemplate
    messages: list[dict[str, str]] = field(default_factory=list)

    def prompt_for(self, question: str) -> str:
        self.messages.append({"role": "user", "content": question})
        return self.template.render(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def unasked(self) -> None:
        """Forget the last question: it got no answer at all."""
        self.messages.pop()


@dataclass(frozen=True)
class Connection:
    address: str
    security: MeshSecurity
    api_key: str | None
    timeout_s: float


async def _answer(conn: Connection, prompt: str, sampling: dict[str, Any], completion: Completion) -> None:
    request = build_request(prompt, **sampling)
    async for msg in stream(conn.address, request, conn.timeout_s, conn.security, conn.api_key):
        text = accumulate(completion, msg)
        if text:
            click.echo(text, nl=False)


def ask(conn: Connection, conversation: Conversation, question: str, sampling: dict[str, Any]) -> None:
    """One turn: stream the answer; Ctrl-C stops it and keeps what came."""
    completion = Completion()
    start = time.perf_counter()
    ended = ""
    try:
        asyncio.run(_answer(conn, conversation.prompt_for(question), sampling, completion))
    except KeyboardInterrupt:  # asyncio.run cancelled the stream: the router aborts the request
        ended = "stopped"
    except grpc.RpcError as err:
        ended = f"{err.code().name}: {err.details()}"
    if completion.text or not ended:
        conversation.answered(completion.text)
    else:
        conversation.unasked()
    usage = completion.usage
    parts = [ended or completion.finish_reason or "?", f"{len(completion.token_ids)} tokens"]
    if usage:
        parts.append(f"prompt {usage['prompt_tokens']} tokens ({usage['cached_prompt_tokens']} cached)")
    parts.append(f"{time.perf_counter() - start:.1f} s")
    click.echo(f"\n[{' · '.join(parts)}]", err=True)


def read_question() -> str | None:
    """The next line; None at end of input. Ctrl-C at the prompt starts a new line."""
    while True:
        try:
            return input(PROMPT)
        except KeyboardInterrupt:
            click.echo("", err=True)
        except EOFError:
            return None


@click.command()
@click.option("--addr", default="127.0.0.1:8470", show_default=True, help="the router's HOST:PORT (or several)")
@click.option("--model", "model_dir", default=None,
              help="the model the router serves, for its chat template (a directory or a pulled model's name; "
                   "default: the embedded model)")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="per answer")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy")
@click.option("--ignore-eos", is_flag=True, help="answer until --max-tokens (testing)")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="an answer's deadline in seconds")
@click.option("--tls-ca", default=None, envvar=KERVAN_TLS_CA, help="the router's CA (PEM): connect with TLS")
@click.option("--api-key", default=None, envvar=KERVAN_API_KEY, help="for a router that requires one")
def chat(addr: str, model_dir: str | None, max_tokens: int, temperature: float, ignore_eos: bool, timeout: float,
         tls_ca: str | None, api_key: str | None) -> None:
    """Talk with the model a running router serves (Ctrl-C stops an answer, Ctrl-D leaves)."""
    from control_plane.tools.model_arg import model_path

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 (line editing and ↑ for earlier lines, where Python has it)
    conn = Connection(addr, MeshSecurity.from_files(None, None, tls_ca), api_key, timeout)
    conversation = Conversation(ChatTemplate.from_dir(model_path(model_dir, pull_missing=True)))
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
    click.echo(f"chatting with {addr}: Ctrl-C stops an answer, /reset forgets, Ctrl-D or /exit leaves", err=True)
    while (question := read_question()) is not None:
        question = question.strip()
        if question in ("/exit", "/quit"):
            break
        if question == "/reset":
            conversation.messages.clear()
            click.echo("[history forgotten]", err=True)
        elif question:
            ask(conn, conversation, question, sampling)
    click.echo("", err=True)
    sys.stdout.flush()
