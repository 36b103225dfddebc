"""The benchmark model's tokenizer: a synthetic Llama-style BPE of exactly 32000 tokens.

The benchmark Llama (bench/workloads.py) has random weights and no real tokenizer, but the
serving benchmark streams text and llama.cpp's converter needs a vocabulary, so both
engines get this one:

- ids 0, 1, 2: `<unk>`, `<s>` (BOS), `</s>` (EOS), as in the model's config;
- ids 3..130: the 128 ASCII byte-fallback tokens `<0x00>`..`<0x7F>`;
- then the 32 characters of `ALPHABET` (`▁` is the space), all 1024 pairs of them and the
  first 30813 of their triples (ordered by how common their characters are), each pair
  and triple reached by one merge (`a`+`b`, `ab`+`c`).

Every token decodes to non-empty, complete text on its own and in a stream, so a
streaming detokenizer hands out a delta for every generated token (except ids 0-2 when
special tokens are skipped, jengine's default). That is why there are no byte tokens
0x80-0xFF: alone, each is an incomplete UTF-8 character, which jengine's detokenizer and
llama-server both hold back until a later token completes it (with them, greedy workload A
gave 62 empty deltas in 16384 tokens). The price: a non-ASCII character outside the
alphabet encodes to `<unk>` in transformers and makes llama.cpp's text tokenizer fail;
the benchmarks send token ids, so neither matters there.

A BPE with `byte_fallback`, a Metaspace pre-tokenizer that adds no prefix space
(`add_prefix_space: false`) and the Llama decoder Replace("▁", " ") / ByteFallback / Fuse
without the leading-space Strip (so the token `▁` is " ", not ""). Saved through
`transformers.PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(folder)` loads it
as it is, and llama.cpp's `convert_hf_to_gguf.py` reads it through its Llama HF-vocab path
(`gguf.LlamaHfVocab`, which wants a BPE with byte_fallback and a Sequence decoder; no
pre-tokenizer hash) as a "llama" (SentencePiece-style) vocab with `add_space_prefix`
false. (The converter imports `sentencepiece` before it looks for tokenizer.model, so that
package must be installed although no SentencePiece model is involved.) Text tokenization
differs between the engines (the converter gives llama.cpp's merges no scores); with
token-id prompts that does not matter.

Deterministic: the same files every time.
"""

import itertools
import json
import os

# The space marker first, then letters in order of English frequency, then punctuation.
ALPHABET = "▁etaoinshrdlcumwfgypbvkjxqz.,'-!"
VOCAB_SIZE = 32000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(128)]
    merges: list[tuple[str, str]] = []
    tokens += list(ALPHABET)
    for a, b in itertools.product(ALPHABET, repeat=2):
        tokens.append(a + b)
        merges.append((a, b))
    rank = {c: i for i, c in enumerate(ALPHABET)}
    triples = sorted(
        itertools.product(ALPHABET, repeat=3),
        key=lambda t: (sum(rank[c] for c in t), [rank[c] for c in t]),
    )
    for a, b, c in triples[: VOCAB_SIZE - len(tokens)]:
        tokens.append(a + b + c)
        merges.append((a + b, c))
    assert len(tokens) == len(set(tokens)) == VOCAB_SIZE, len(tokens)
    return {t: i for i, t in enumerate(tokens)}, merges


def build_tokenizer():
    """The `tokenizers.Tokenizer` (not saved)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab, merges = _vocab_and_merges()
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=False
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def write_bench_tokenizer(folder: str) -> None:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json) into `folder`."""
    from transformers import PreTrainedTokenizerFast

    os.makedirs(folder, exist_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    ).save_pretrained(folder)
    # The generic fast tokenizer class, named as every transformers version knows it, so
    # tokenizer.json is used as it is: transformers 5's LlamaTokenizer would rebuild the
    # BPE from the vocabulary without its unk token (dropping characters it cannot
    # encode), and transformers 4's LlamaTokenizerFast would want a SentencePiece model
    # for add_prefix_space.
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
