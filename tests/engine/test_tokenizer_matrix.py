"""The tokenizers users bring, each under a random-weight model of the same shape (one set of
compiled programs for all): the bundled model's, SmolLM2's (from its GGUF), byte-level BPE
saved without a decoder, sentencepiece-style (Metaspace, byte fallback), word-level, and one
with added tokens that are not special (as Qwen's `<think>`).
Each runs its chat template, incremental detokenization (the streamed pieces join into the
final text, which is what decoding the ids after the prompt gives), a stop string and one
constrained request whose output meets its constraint."""

import json
import re
import shutil

import pytest
import torch
import transformers

from jengine import LLM, SamplingParams
from jengine.engine.tokenizer import gguf_tokenizer, load_tokenizer_from
from jengine.entrypoints.openai.logprob_format import LogprobFormat
from jengine.models.checkpoint import BUNDLED_MODEL_PATH, installed_smollm2
from jengine.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.engine.tokenizer_kinds import KINDS, save_tokenizer

# SmolLM2's vocabulary: every model here has it, so all share their compiled programs.
VOCAB = 49152
ENGINE = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, block_size=16,
              num_gpu_blocks_override=32, dtype="float32", warmup=False)  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, world! To be, or not to be"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHOICE = {
    "type": "object",
    "properties": {"n": {"enum": [1, 2, 3]}},
    "required": ["n"],
    "additionalProperties": False,
}
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>"]
# A word-level vocabulary joins its words with spaces: the grammar sees them (see below).
WORDS = r"( (the|a|and|dog|quick)){3}"


def _tokenizer_into(kind: str, folder: str) -> None:
    if kind == "bundled":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{BUNDLED_MODEL_PATH}/{name}", folder)
    elif kind == "smollm2":
        gguf_tokenizer(installed_smollm2()).save_pretrained(folder)
    elif kind == "plain-added-tokens":  # as Qwen's: added tokens that are not special
        tokenizer = transformers.AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH)
        tokenizer.add_tokens(PLAIN_ADDED, special_tokens=False)
        tokenizer.save_pretrained(folder)
    else:
        save_tokenizer(kind, folder)


def make_model(kind: str, folder: str) -> str:
    """`kind`'s tokenizer and a random 2-layer Llama over VOCAB ids; ids past the
    tokenizer and EOS score 0 against logits spread over several units, so greedy decoding
    picks real tokens and runs to max_tokens."""
    _tokenizer_into(kind, folder)
    tokenizer = load_tokenizer_from(folder)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.08 * torch.randn_like(param))
            if name.endswith("norm.weight"):
                param.fill_(1.0)
        head = model.lm_head.weight
        head.mul_(5.0)
        head[len(tokenizer) :] = 0
        head[tokenizer.eos_token_id] = 0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["bundled", "smollm2", "plain-added-tokens", *KINDS])
def row(request, tmp_path_factory):
    folder = make_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    llm = LLM(folder, **ENGINE)
    yield request.param, llm
    llm.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_chat_template(row):
    _, llm = row
    text, token_ids = llm.llm_engine.input_processor.render_chat(MESSAGES)
    assert MESSAGES[0]["content"] in text and len(token_ids) > 5
    [reply] = llm.chat(MESSAGES, greedy(8), use_tqdm=False)
    assert reply.prompt_token_ids == token_ids and len(reply.outputs[0].token_ids) == 8


def test_incremental_detokenization_and_a_stop_string(row):
    kind, llm = row
    tokenizer = llm.llm_engine.tokenizer
    engine = llm.llm_engine
    engine.add_request("stream", PROMPT, greedy(32), output_kind=RequestOutputKind.DELTA)
    pieces, token_ids = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)
            token_ids += output.outputs[0].token_ids  # deltas: each output's new ids
    text = "".join(pieces)
    prompt_ids = tokenizer.encode(PROMPT)
    decoded = tokenizer.decode(prompt_ids + token_ids, skip_special_tokens=True)
    assert text and text == decoded[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :]
    assert "Ġ" not in text and "▁" not in text  # the byte alphabet and Metaspace decoded
    # A stop string from the middle of the text: cut right before it.
    middle = len(text) // 2
    stop = next(text[i : i + 2] for i in range(middle, len(text) - 1) if text[i : i + 2].strip())
    [cut] = llm.generate(PROMPT, greedy(32, stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].text == text[: text.index(stop)], kind
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop


def test_logprob_bytes_spell_split_characters(row):
    """OpenAI's logprob `bytes`: each token's text is what the server writes (U+FFFD where
    a token holds part of a character), and the tokens' bytes join into the text's UTF-8,
    characters split over byte-level and byte-fallback tokens included. A word-level
    vocabulary has no pieces of characters: its tokens' bytes are their texts'."""
    kind, llm = row
    tokenizer = llm.llm_engine.tokenizer
    logprob_format = LogprobFormat(tokenizer)
    text = "日本語🐱café"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = [logprob_format.token_str(token_id) for token_id in token_ids]
    spelled = [logprob_format.token_bytes(i, token) for i, token in zip(token_ids, tokens)]
    if kind == "word-level":
        assert spelled == [list(token.encode()) for token in tokens]
        return
    assert any("\ufffd" in token for token in tokens), kind
    assert b"".join(map(bytes, spelled)) == text.encode(), kind


def test_one_constrained_request(row):
    kind, llm = row
    if kind == "word-level":
        # Word-level text has a space before every word, so JSON cannot even begin: the
        # request fails naming why (a ValueError offline), never an empty success ...
        json_params = greedy(16, structured_outputs=StructuredOutputsParams(json=CHOICE))
        with pytest.raises(ValueError, match="cannot be met with this model's vocabulary"):
            llm.generate(PROMPT, json_params, use_tqdm=False)
        # ... while a constraint that allows the spaces is met.
        params = greedy(16, structured_outputs=StructuredOutputsParams(regex=WORDS))
        [output] = llm.generate(PROMPT, params, use_tqdm=False)
        assert re.fullmatch(WORDS, output.outputs[0].text)
    elif kind == "plain-added-tokens":
        # Fixed text that holds an added token is met, by that token where the grammar
        # library forces it (it once forced the token, then refused it as special).
        tag = {"type": "object", "properties": {"tag": {"const": "<tool_call>"}}}
        for constraint, expected in (
            (dict(choice=["<tool_call>"]), "<tool_call>"),
            (dict(choice=["Answer: <think>"]), "Answer: <think>"),
            (dict(json={**tag, "required": ["tag"]}), '{"tag": "<tool_call>"}'),
        ):
            params = greedy(24, structured_outputs=StructuredOutputsParams(**constraint))
            [output] = llm.generate(PROMPT, params, use_tqdm=False)
            assert output.outputs[0].text.replace(" ", "") == expected.replace(" ", "")
    else:
        params = greedy(24, structured_outputs=StructuredOutputsParams(json=CHOICE))
        [output] = llm.generate(PROMPT, params, use_tqdm=False)
        assert json.loads(output.outputs[0].text)["n"] in (1, 2, 3)
    assert output.outputs[0].finish_reason == "stop"
