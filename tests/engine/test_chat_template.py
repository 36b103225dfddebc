"""`--chat-template` / `chat_template=`: a file or a template string, rendered instead of the
model's own template; a name that is neither is a clear error."""

import pytest

from jengine.engine.input_processor import InputProcessor, load_chat_template
from tests.entrypoints.tiny_model import TOOL_CHAT_TEMPLATE, make_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_file_or_a_string(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TOOL_CHAT_TEMPLATE)
    assert load_chat_template(str(path)) == TOOL_CHAT_TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_rendered_instead_of_the_models_own(tmp_path):
    tokenizer = make_tokenizer(str(tmp_path))
    processor = InputProcessor(tokenizer, max_model_len=128, vocab_size=len(tokenizer))
    own, _ = processor.render_chat(MESSAGES)
    assert own == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    other, token_ids = processor.render_chat(MESSAGES, chat_template="[{{ messages[0].content }}]")
    assert other == "[Hi]" and tokenizer.decode(token_ids) == "[Hi]"
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template; give one"):
        processor.render_chat(MESSAGES)
    assert processor.render_chat(MESSAGES, chat_template="{{ 'x' }}")[0] == "x"
