"""Beam search over the engine, as vLLM's `LLM.beam_search` runs it.

Where it sits: `LLM.beam_search` calls `beam_search` with itself as the engine. Each step
asks the engine for one more token of every live beam of every prompt, with the top
2 x beam_width logprobs (`SamplingParams(max_tokens=1, logprobs=2 * beam_width)`); each
beam's candidates are pooled per prompt, a candidate ending in EOS is set aside as
finished, and the beam_width others with the highest cumulative logprob go on. Beams share
their prompt and earlier tokens through the prefix cache, so a step recomputes only each
beam's last, partial block. At the end, the finished and live beams are ranked by
`beam_score` and the best beam_width are returned.

Promises (vLLM's semantics): `BeamSearchSequence.tokens` are the prompt's and the beam's,
`text` the beam's alone (without the EOS that ended it), `cum_logprob` the sum of its
tokens' logprobs; where no beam ends (`ignore_eos`), the beams are transformers' beam
search's with `num_beams=beam_width` (the 2 x beam_width candidates hold every beam's
share of the best beam_width). With temperature > 0 each beam's sampled token joins its
candidates (it is in the logprobs row), as in vLLM. A beam that reaches max_model_len
stops there ("length").
"""

from dataclasses import dataclass, field

from jengine.outputs import Logprob
from jengine.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` the prompt's then its own; `logprobs` one row per own token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's ranking: the cumulative logprob over the sequence's length (prompt
    included, an EOS that ended it not) to the power `length_penalty`."""
    length = len(beam.tokens) - (beam.finish_reason == "stop")
    return beam.cum_logprob / (length**length_penalty)


def beam_search(llm, prompts: list, params: BeamSearchParams, lora_request=None):
    """Beam search for each prompt (a string, token ids or a prompt dict) on `llm`, an
    `LLM`; returns one BeamSearchOutput per prompt, in order."""
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    # The ids that end a request in generate: the model's EOS and its generation config's.
    processor = engine.input_processor
    eos_token_ids = {processor.eos_token_id, *processor.extra_eos_ids} - {None}
    max_model_len = engine.config.scheduler.max_model_len
    if 2 * params.beam_width > processor.max_logprobs:
        raise ValueError(
            f"beam_width {params.beam_width} takes {2 * params.beam_width} logprobs a step, "
            f"more than the engine's max_logprobs ({processor.max_logprobs}); make the LLM "
            "with a larger max_logprobs"
        )
    step = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
    )
    if not isinstance(prompts, list | tuple):
        prompts = [prompts]
    # Each prompt tokenized and checked as generate would, before any step runs.
    starts = []
    for prompt in prompts:
        _, request = engine.input_processor.process(
            engine.next_request_id(), prompt, step, lora_request=lora_request
        )
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        starts.append((list(request.prompt_token_ids), salt))
    live = [[BeamSearchSequence(tokens)] for tokens, _ in starts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    for _ in range(params.max_tokens):
        beams = [(i, beam) for i, group in enumerate(live) for beam in group]
        if not beams:
            break
        batch = [_beam_prompt(beam.tokens, starts[i][1]) for i, beam in beams]
        outputs = llm.generate(batch, step, use_tqdm=False, lora_request=lora_request)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), output in zip(beams, outputs, strict=True):
            [row] = output.outputs[0].logprobs
            for token_id, logprob in row.items():
                grown = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [row],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in eos_token_ids and not params.ignore_eos:
                    grown.finish_reason = "stop"
                    finished[i].append(grown)
                elif len(grown.tokens) >= max_model_len:
                    grown.finish_reason = "length"
                    finished[i].append(grown)
                else:
                    candidates[i].append(grown)
        live = [
            sorted(group, key=lambda b: b.cum_logprob, reverse=True)[: params.beam_width]
            for group in candidates
        ]

    results = []
    for (prompt_tokens, _), group, done in zip(starts, live, finished, strict=True):
        for beam in group:
            beam.finish_reason = "length"
        ranked = sorted(
            done + group,
            key=lambda b: beam_score(b, params.length_penalty),
            reverse=True,
        )[: params.beam_width]
        for beam in ranked:
            own = beam.tokens[len(prompt_tokens) :]
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                own = own[:-1]
            beam.text = tokenizer.decode(own) if tokenizer is not None else None
        results.append(BeamSearchOutput(ranked))
    return results


def _beam_prompt(tokens: list[int], cache_salt: str | None) -> dict:
    prompt = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt
