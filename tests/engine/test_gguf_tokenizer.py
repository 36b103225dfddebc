"""The tokenizer of a GGUF is the one transformers builds from the same file (jengine feeds
transformers' converter from its own reader, which needs no torch)."""

import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from jengine.engine.tokenizer import gguf_tokenizer
from jengine.models.checkpoint import installed_smollm2

TEXTS = [
    "What is the capital of France?",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé, 日本語 and an emoji 🤖",
    "numbers 1234567 and 3.14159; don't, can't, won't",
    "<|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizers():
    path = installed_smollm2()
    folder, name = os.path.split(path)
    return gguf_tokenizer(path), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_encodes_decodes_and_templates_as_transformers(tokenizers):
    ours, theirs = tokenizers
    assert len(ours) == len(theirs) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_ids"):
        assert getattr(ours, name) == getattr(theirs, name), name
    messages = [{"role": "user", "content": "Hello"}]
    render = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, **render) == theirs.apply_chat_template(
        messages, **render
    )
    assert ours.eos_token == "<|im_end|>"  # what ends a chat turn


def test_loads_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from jengine.engine.tokenizer import gguf_tokenizer; "
        "from jengine.models.checkpoint import installed_smollm2; "
        "print(gguf_tokenizer(installed_smollm2()).encode('Paris'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith("[")
