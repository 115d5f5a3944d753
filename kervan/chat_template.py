"""Chat messages -> one prompt string, with the model's chat template.

The template is the model directory's ``chat_template.jinja`` (where transformers
saves it since 4.43), else ``chat_template`` in its ``tokenizer_config.json`` (a Jinja
string, or a list of named ones, of which "default" is taken), rendered as
transformers' ``apply_chat_template`` renders it: a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` filter,
``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables. A model without a template gets
``DEFAULT_TEMPLATE`` (ChatML: ``<|im_start|>role\\ncontent<|im_end|>`` per message,
then ``<|im_start|>assistant\\n``)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kervan.sampling import InvalidRequest

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.special_tokens = special_tokens or {}
        self.is_default = template == DEFAULT_TEMPLATE

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        jinja = Path(model_dir) / "chat_template.jinja"  # where transformers >= 4.43 saves it
        template = (jinja.read_text() if jinja.is_file() else None) or config.get("chat_template") or DEFAULT_TEMPLATE
        if isinstance(template, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or DEFAULT_TEMPLATE
        tokens = {}
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[name] = value
        return cls(template, tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages`` (OpenAI's shape: role and content, content a string
        or a list of text parts); a malformed list or a template's own exception is the
        client's mistake."""
        checked = [_message(m, i) for i, m in enumerate(messages)] if isinstance(messages, list) else None
        if not checked:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
        try:
            return self.template.render(messages=checked, add_generation_prompt=add_generation_prompt, tools=None,
                                        documents=None, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from None


def _message(message: object, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise InvalidRequest(f"messages[{index}] needs a role, one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is served
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):
            raise InvalidRequest(f"messages[{index}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if content is None and message["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{index}].content must be a string or a list of text parts")
    return {**{k: v for k, v in message.items() if k in ("role", "name")}, "content": content}


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
