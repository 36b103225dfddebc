"""A tiny servable model: a byte-level BPE tokenizer with a chat template, trained here on a
few KB of inline text, plus a random-weight Llama whose vocabulary matches it.

Used by the serving tests, which need a real tokenizer (text prompts, stop strings, chat)
and a model small enough that the engine warms up in seconds. The weights are random, so
text is gibberish, but greedy decoding is deterministic, which is all the tests rely on.

Two choices keep the assertions simple:
- the BPE alphabet is printable ASCII only (no 256-byte base alphabet), so every token
  decodes to clean ASCII and a random model never emits broken UTF-8;
- the EOS row of the output projection is zero and the other rows are scaled up, so EOS
  scores 0 against logits spread over several units: it is never the argmax and is almost
  never sampled, so `max_tokens` reliably ends generation with "length".
"""

import os
import string

VOCAB_SIZE = 384
# One shape set for every engine the tests start on this model, so that after the first
# start the persistent XLA cache makes each further start take seconds.
ENGINE_ARGS = dict(
    max_model_len=128,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    block_size=16,
    num_gpu_blocks_override=256,
    dtype="float32",
)
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# What `--chat-template` gives the serving tests' server: the same turns, plus the tools and
# the assistant's earlier calls, which the model's own template leaves out.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "call {{ call.function.name }} {{ call.function.arguments | tojson }}"
    "{% endfor %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TEXT = """\
Once upon a time there was a small engine that served words to anyone who asked.
It read each prompt, thought for a while, and answered one token at a time.
The scheduler kept a list of running requests and a queue of waiting ones.
When memory ran short it set a request aside and computed it again later.
Blocks of sixteen tokens were hashed, so a shared prefix was computed only once.
The quick brown fox jumps over the lazy dog; the lazy dog does not mind at all.
Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump?
Sphinx of black quartz, judge my vow. Waltz, bad nymph, for quick jigs vex.
A user asked: what is the capital of France? The assistant said: Paris, of course.
Numbers count too: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 65536 3.14159.
Code looks like this: def add(a, b): return a + b  # and {"key": [1, 2, 3]}.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.
Shall I compare thee to a summer's day? Thou art more lovely and more temperate.
Rough winds do shake the darling buds of May, and summer's lease hath all too short a date.
Hello, world! Hello there. Good morning, good evening, good night, and goodbye.
The engine streamed its answers as events; each event carried a little more text.
Some clients left early; their requests were aborted and their blocks returned to the pool.
"""


def training_text() -> list[str]:
    lines = _TEXT.splitlines()
    # Every printable ASCII character, so any ASCII prompt tokenizes without an unknown token.
    return lines * 4 + [string.printable]


def make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: str, seed: int = 0) -> str:
    """Write tokenizer + random Llama to `path` (created if needed); returns `path`."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(path)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,  # LONG_SERVER_ARGS, TIGHT_ENGINE_ARGS run past 256
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name == "lm_head.weight":
                param.copy_(0.4 * torch.randn_like(param))
                param[eos_id].zero_()
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1]))
