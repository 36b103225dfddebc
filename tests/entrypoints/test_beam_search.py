"""`LLM.beam_search` (vLLM's): with no beam ending, the beams of transformers' own beam
search; with EOS, vLLM's algorithm run on transformers' logits; bad parameters are
ValueErrors naming them, before anything runs; no block is left behind and nothing
compiles after warmup. (On a real chat model: tests/models/test_smollm2.py.)"""

import numpy as np
import pytest
import torch

from jengine.sampling_params import BeamSearchParams
from tests.engine.engine_helpers import make_llm, random_prompts


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint[0], "default-bs16")


def _log_softmax(hf_model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0, -1].double()
    return torch.log_softmax(logits, -1).numpy()


def test_without_an_end_the_beams_are_transformers(llm, checkpoint):
    hf_model = checkpoint[1]
    prompts = random_prompts(2, seed=11, low=5, high=40)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            theirs = hf_model.generate(
                torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                max_new_tokens=6, min_new_tokens=6, length_penalty=0.0, early_stopping=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        assert [b.tokens for b in output.sequences] == theirs.sequences.tolist()
        scores = [b.cum_logprob for b in output.sequences]
        np.testing.assert_allclose(scores, theirs.sequences_scores.numpy(), atol=1e-4, rtol=0)
        for beam in output.sequences:
            assert beam.finish_reason == "length" and len(beam.logprobs) == 6
            own = beam.tokens[len(prompt) :]
            assert sum(row[t].logprob for row, t in zip(beam.logprobs, own)) == pytest.approx(
                beam.cum_logprob, abs=1e-4
            )


def _reference(hf_model, prompt, width, max_tokens, eos, length_penalty):
    """vLLM's beam search on transformers' logprobs: (tokens, cum_logprob, finish)."""
    live, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            logprobs = _log_softmax(hf_model, tokens)
            for token in np.argsort(-logprobs)[: 2 * width].tolist():
                beam = (tokens + [token], cum + logprobs[token])
                (done if token == eos else grown).append((*beam, "stop" if token == eos else ""))
        live = [b[:2] for b in sorted(grown, key=lambda b: -b[1])[:width]]
        if not live:
            break
    ranked = done + [(tokens, cum, "length") for tokens, cum in live]

    def score(beam):
        return beam[1] / ((len(beam[0]) - (beam[2] == "stop")) ** length_penalty)

    return sorted(ranked, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_that_end_are_ranked_as_vllm_ranks_them(llm, checkpoint, length_penalty):
    hf_model = checkpoint[1]
    eos = llm.llm_engine.input_processor.eos_token_id
    # Prompts whose beams meet EOS among their candidates within the first steps.
    prompts = [p for p in random_prompts(40, seed=3, low=5, high=30)
               if eos in np.argsort(-_log_softmax(hf_model, p))[:8]][:2]  # fmt: skip
    assert prompts, "no prompt puts EOS among its first candidates"
    params = BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = _reference(hf_model, prompt, 4, 5, eos, length_penalty)
        assert [b.tokens for b in output.sequences] == [b[0] for b in expected]
        assert [b.finish_reason for b in output.sequences] == [b[2] for b in expected]
        np.testing.assert_allclose(
            [b.cum_logprob for b in output.sequences], [b[1] for b in expected], atol=1e-4
        )
        assert any(b.finish_reason == "stop" for b in output.sequences)


def test_bad_parameters_are_named_and_harm_nothing(llm):
    for kwargs, name in (
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=True), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ):
        with pytest.raises(ValueError, match=f"^{name} "):
            BeamSearchParams(**kwargs)
    free = llm.engine_core.num_free_blocks()
    with pytest.raises(ValueError, match="beam_width 11 takes 22 logprobs"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.beam_search([[5, 6, 7], [9] * 500], BeamSearchParams(beam_width=2, max_tokens=2))
    [output] = llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(output.sequences) == 2
    # A LoRA request per prompt, as generate takes them: each beam runs with its prompt's
    # (the list was handed to every step, whose beams outnumber the prompts).
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        llm.beam_search([[5, 6, 7], [8, 9]], params, lora_request=[None])
    each = llm.beam_search([[5, 6, 7], [8, 9]], params, lora_request=[None, None])
    assert [o.sequences for o in each] == [
        o.sequences for o in llm.beam_search([[5, 6, 7], [8, 9]], params)
    ]
    # Beams stop at max_model_len (96): two tokens past a 94-token prompt.
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    [output] = llm.beam_search([[9] * 94], params)
    assert {len(b.tokens) for b in output.sequences} == {96}
    assert llm.engine_core.num_free_blocks() == free
    assert llm.engine_core.compiles_after_warmup() == 0
