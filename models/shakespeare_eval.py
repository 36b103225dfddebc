"""Evaluating a trained Shakespeare folder with transformers (PyTorch): perplexity on the
fixed validation sample, and a sample of text.

Where it sits: offline tooling; `models/train_shakespeare.py` reports both after
training, and tests/engine/test_bundled_model.py checks the bundled model's perplexity
with `evaluate_with_transformers`. Imports torch and transformers only when called.
"""

import math


def evaluate_with_transformers(folder: str, text: str, window: int = 256) -> dict:
    """Perplexity of `text` under the HF folder, computed by transformers (PyTorch, f32).

    Protocol: tokenize without special tokens, cut into non-overlapping windows of
    `window` tokens (the last one may be shorter), predict every token of a window but its
    first from the ones before it in the window; mean NLL over all predicted tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    total_nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
            total_nll += nll.item()
            count += chunk.shape[1] - 1
    nll = total_nll / count
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": count, "window": window}


def sample_with_transformers(folder: str, prompt: str, max_new_tokens: int, seed: int, **kw):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=0, **kw)
    return tokenizer.decode(out[0], skip_special_tokens=False)
