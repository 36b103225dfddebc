"""A model that says what a test scripts: the tiny model's tokenizer plus one token for each
piece of each script, and a one-layer Llama whose every layer adds nothing to the residual
stream, so each next token depends on the current token alone.

Used where what a random model says cannot reach the code under test: a tool-call parser
needs a reply in its format, special tokens and all, and the engine must carry it from
the sampler through detokenization to the parser as a real model's reply.

How a script plays: the chat template renders only the messages' contents, so a prompt
that ends with a script's trigger word makes the reply that script's pieces, one token
each, then EOS. Each piece (and trigger) gets its own direction of the hidden state: its
embedding is that direction, the attention and MLP outputs are zero, and the LM head's row
for the piece after it reads that direction. Every other token's embedding is zero, so its
logits are all zero and the greedy choice is token 0, EOS. A piece may appear only once in
all the scripts.
"""

from tests.entrypoints.tiny_model import EOS, make_tokenizer

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def make_scripted_model(
    path: str, scripts: dict[str, list[str]], special: tuple[str, ...] = ()
) -> str:
    """Write the model to `path`: `scripts` maps a trigger word to the pieces the reply is
    made of; the pieces in `special` are special tokens. Returns `path`."""
    import torch
    import transformers

    chains = [[trigger, *pieces] for trigger, pieces in scripts.items()]
    tokens = [token for chain in chains for token in chain]
    assert len(set(tokens)) == len(tokens), "a piece may appear in one place only"
    tokenizer = make_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.add_tokens([t for t in tokens if t not in special])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    assert eos_id == 0  # what a token outside the scripts is followed by
    hidden_size = 64
    assert len(tokens) <= hidden_size
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for chain in chains:
            ids = tokenizer.convert_tokens_to_ids(chain)
            for token, token_id, next_id in zip(chain, ids, [*ids[1:], eos_id], strict=True):
                direction = tokens.index(token)
                embed[token_id, direction] = 1.0
                head[next_id, direction] = 10.0
    model.save_pretrained(path)
    return path
