"""Hugging Face transformers as a peer: `generate` tuned fairly, on the same model and
prompts as jengine.

Where it sits: the throughput and latency benchmarks build one `TransformersPeer` per run
and time it beside jengine. Fair means: float32, the same thread count, prompts sorted by
length so a static batch wastes little padding, several batch sizes tried (the best is
the peer's figure), an explicit attention mask always (without one `generate` infers a
mask from `pad_token_id` and can hide real prompt tokens), and EOS masked exactly as on
jengine's side (`min_new_tokens` = the output length, so every request makes all its
tokens).
"""

import os
import time

import torch


class TransformersPeer:
    name = "transformers"

    def __init__(self, path: str, threads: int):
        import transformers

        torch.set_num_threads(threads)
        # A GGUF file loads dequantized, as transformers does with `gguf_file`.
        folder, gguf_file = os.path.split(path) if path.endswith(".gguf") else (path, None)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=torch.float32
        ).eval()
        self.model.generation_config.pad_token_id = 0
        self.version = transformers.__version__

    def _generate_batch(
        self, batch: list[list[int]], max_tokens: int, top_p: float | None = None
    ) -> list[list[int]]:
        """Greedy, or sampled at temperature 1 with `top_p`."""
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        sampling = (
            dict(do_sample=True, temperature=1.0, top_p=top_p, top_k=0)
            if top_p
            else dict(do_sample=False)
        )
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                **sampling,
            )
        return out[:, width:].tolist()

    def generate(
        self, prompts: list[list[int]], max_tokens: int, batch_size: int
    ) -> list[list[int]]:
        """Greedy outputs in prompt order; batches are formed over length-sorted prompts."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        outputs: list[list[int] | None] = [None] * len(prompts)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            for row, tokens in zip(
                rows, self._generate_batch([prompts[i] for i in rows], max_tokens), strict=True
            ):
                outputs[row] = tokens
        return outputs

    def latency(self, prompt: list[int], max_tokens: int, top_p: float | None = None) -> dict:
        """Time to first token and single-stream decode rate of one request (greedy, or
        sampled with `top_p`)."""
        self._generate_batch([prompt], 2, top_p)  # first-run costs
        started = time.perf_counter()
        self._generate_batch([prompt], 1, top_p)
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        self._generate_batch([prompt], max_tokens, top_p)
        total = time.perf_counter() - started
        return dict(ttft_s=ttft, decode_tok_per_s=(max_tokens - 1) / max(total - ttft, 1e-9))
