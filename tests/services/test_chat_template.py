"""Chat templates render as transformers' ``apply_chat_template`` renders them (the
same template, messages and special tokens give the same prompt), named templates
and text parts are understood, and malformed messages are the client's mistake."""

import json

import pytest

from kervan.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from kervan.sampling import InvalidRequest

# in the manner of Llama 3's and Qwen's templates: special tokens, loop controls,
# raise_exception, tojson, a system message moved first
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{{ {'n': messages | length} | tojson }}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "  Hello there  "}, {"role": "assistant", "content": "Hi."},
            {"role": "tool", "content": "ignored"}, {"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("template", [LLAMA3_LIKE, QWEN_LIKE, DEFAULT_TEMPLATE])
def test_renders_what_transformers_renders(default_model_dir, tmp_path, template):
    from transformers import PreTrainedTokenizerFast
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(default_model_dir / "tokenizer.json"), bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = template
    for generation_prompt in (True, False):
        expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert ChatTemplate.from_dir(tmp_path).render(MESSAGES, generation_prompt) == expected


def test_named_templates_text_parts_and_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ChatTemplate.from_dir(tmp_path).render(parts) == "ab"
    assert ChatTemplate.from_dir(tmp_path / "nowhere").is_default  # no tokenizer_config.json: ChatML


def test_malformed_messages_and_template_exceptions_are_client_mistakes(tmp_path):
    template = ChatTemplate(LLAMA3_LIKE, {"bos_token": "<s>"})
    for bad, match in (([], "non-empty list"), ("hi", "non-empty list"), ([{"content": "x"}], "needs a role"),
                       ([{"role": "user", "content": 3}], "must be a string"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts")):
        with pytest.raises(InvalidRequest, match=match):
            template.render(bad)
    with pytest.raises(InvalidRequest, match="bad role"):  # the template's own raise_exception
        template.render([{"role": "developer", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")  # the sandbox refuses attribute escapes
    with pytest.raises(InvalidRequest):
        sandboxed.render([{"role": "user", "content": "x"}])


def test_chat_template_jinja_beside_the_config_wins(tmp_path):
    """transformers >= 4.43 saves the template as chat_template.jinja (a pulled model has one)."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "hi"}]) == "hi!"
