"""Beam search over the engine, as vLLM runs it (`LLM.beam_search`, and `use_beam_search`
on the OpenAI routes).

Where it sits: `BeamSearch` holds the beams of a batch of prompts and knows nothing of
engines; two drivers run it: `beam_search` over an `LLM` (offline, in order) and
`beam_search_output` over an `AsyncLLM` (the API server; jax-free, as this module is).
Each step asks the engine for one more token of every live beam, with the top
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
candidates (it is in the logprobs row), as in vLLM. A beam stops ("length") once it holds
max_model_len tokens (as in generate, a prompt of max_model_len tokens still gets one).
EOS is every id that ends a request in `generate` (the model's and its generation
config's). A beam runs with its prompt's LoRA adapter.
"""

import asyncio
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from jengine.lora_request import LoRARequest
from jengine.outputs import CompletionOutput, Logprob, RequestOutput
from jengine.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` the prompt's then its own; `logprobs` one row per own token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's ranking: the cumulative logprob over the sequence's length (prompt
    included, an EOS that ended it not) to the power `length_penalty`."""
    length = len(beam.tokens) - (beam.finish_reason == "stop")
    return beam.cum_logprob / (length**length_penalty)


class BeamSearch:
    """The beams of several prompts, grown one step at a time by whoever runs the engine:
    `step_beams` says which sequences to extend, `take` reads the engine's logprob row of
    each."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        *,
        eos_token_ids: set[int],
        max_model_len: int,
        max_logprobs: int,
        lora_requests: list[LoRARequest | None] | None = None,
    ):
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(
                f"beam_width {params.beam_width} takes {2 * params.beam_width} logprobs a "
                f"step, more than the engine's max_logprobs ({max_logprobs}); make the "
                "engine with a larger max_logprobs"
            )
        self.params = params
        self.prompts = prompts
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.step_params = SamplingParams(
            max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
        )
        loras = lora_requests or [None] * len(prompts)
        self.live = [
            [BeamSearchSequence(list(p), lora_request=lora)]
            for p, lora in zip(prompts, loras, strict=True)
        ]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._extending: list[tuple[int, BeamSearchSequence]] = []

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def step_beams(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every live beam: the sequences to extend by one."""
        self._extending = [(i, beam) for i, group in enumerate(self.live) for beam in group]
        return list(self._extending)

    def take(self, rows: list[dict[int, Logprob]]) -> None:
        """The engine's logprob row (its candidates) of each beam of `step_beams`."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, beam), row in zip(self._extending, rows, strict=True):
            for token_id, logprob in row.items():
                grown = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [row],
                    beam.lora_request,
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    grown.finish_reason, grown.stop_reason = "stop", token_id
                    self.finished[i].append(grown)
                elif len(grown.tokens) >= self.max_model_len:
                    grown.finish_reason = "length"
                    self.finished[i].append(grown)
                else:
                    candidates[i].append(grown)
        width = self.params.beam_width
        self.live = [
            sorted(group, key=lambda b: b.cum_logprob, reverse=True)[:width] for group in candidates
        ]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """The best beam_width beams of each prompt, finished or not, with their text."""
        outputs = []
        for prompt, live, finished in zip(self.prompts, self.live, self.finished, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            ranked = sorted(
                finished + live,
                key=lambda b: beam_score(b, self.params.length_penalty),
                reverse=True,
            )[: self.params.beam_width]
            for beam in ranked:
                own = beam.tokens[len(prompt) :]
                if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    own = own[:-1]
                beam.text = decode(own) if decode is not None else None
            outputs.append(BeamSearchOutput(ranked))
        return outputs


def eos_token_ids_of(input_processor) -> set[int]:
    """The ids that end a request in generate: the model's EOS and its generation
    config's."""
    ids = {input_processor.eos_token_id, *input_processor.extra_eos_ids}
    return ids - {None}


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None):
    """Beam search for each prompt (a string, token ids or a prompt dict) on `llm`, an
    `LLM`; returns one BeamSearchOutput per prompt, in order. `lora_request`: one for every
    prompt, or a list of one per prompt (None: the base model)."""
    engine = llm.llm_engine
    processor = engine.input_processor
    if not isinstance(prompts, list | tuple) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    loras = (
        lora_request if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
    )
    if len(loras) != len(prompts):
        raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
    starts, salts = [], []
    for prompt, lora in zip(prompts, loras, strict=True):
        # Each tokenized and checked as generate would, before any step runs.
        _, request = processor.process(
            engine.next_request_id(), prompt, SamplingParams(max_tokens=1), lora_request=lora
        )
        starts.append(list(request.prompt_token_ids))
        salts.append(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
    search = BeamSearch(
        starts,
        params,
        eos_token_ids=eos_token_ids_of(processor),
        max_model_len=engine.config.scheduler.max_model_len,
        max_logprobs=processor.max_logprobs,
        lora_requests=list(loras),
    )
    while not search.done:
        beams = search.step_beams()
        batch = [_beam_prompt(beam.tokens, salts[i]) for i, beam in beams]
        step_loras = [beam.lora_request for _, beam in beams]
        outputs = llm.generate(batch, search.step_params, use_tqdm=False, lora_request=step_loras)
        search.take([output.outputs[0].logprobs[0] for output in outputs])
    tokenizer = llm.get_tokenizer()
    return search.results(tokenizer.decode if tokenizer is not None else None)


async def beam_search_output(
    engine,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    *,
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
    num_logprobs: int | None = None,
) -> RequestOutput:
    """Beam search for one prompt on `engine`, an AsyncLLM, as one finished RequestOutput
    whose outputs are the beams, best first (each step's engine requests are
    `<request_id>-beam<step>-<i>`; cancelling this aborts them). `num_logprobs`: each
    token's logprob row cut to the chosen token and that many of the best (None: none)."""
    processor = engine.input_processor
    search = BeamSearch(
        [prompt_token_ids],
        params,
        eos_token_ids=eos_token_ids_of(processor),
        max_model_len=engine.max_model_len,
        max_logprobs=processor.max_logprobs,
        lora_requests=[lora_request],
    )

    async def row(tokens: list[int], engine_id: str) -> dict[int, Logprob]:
        prompt = _beam_prompt(tokens, cache_salt)
        generator = engine.generate(
            prompt, search.step_params, engine_id, lora_request=lora_request
        )
        async with aclosing(generator) as outputs:
            async for output in outputs:
                last = output
        return last.outputs[0].logprobs[0]

    while not search.done:
        tokens = [beam.tokens for _, beam in search.step_beams()]
        engine_ids = [f"{request_id}-beam{search.steps}-{i}" for i in range(len(tokens))]
        search.take(await asyncio.gather(*map(row, tokens, engine_ids)))
    tokenizer = engine.get_tokenizer()
    [result] = search.results(tokenizer.decode if tokenizer is not None else None)
    outputs = []
    for index, beam in enumerate(result.sequences):
        own = beam.tokens[len(prompt_token_ids) :]
        logprobs = None
        if num_logprobs is not None:
            logprobs = [_top(r, t, num_logprobs) for r, t in zip(beam.logprobs, own)]
        completion = CompletionOutput(
            index, beam.text or "", own, beam.cum_logprob, logprobs, beam.finish_reason,
            beam.stop_reason,
        )  # fmt: skip
        outputs.append(completion)
    return RequestOutput(request_id, None, prompt_token_ids, None, outputs, finished=True)


def _top(row: dict[int, Logprob], chosen: int, num: int) -> dict[int, Logprob]:
    """A beam step's row as a request for `num` logprobs gets it: the chosen token, then
    the `num` best."""
    best = sorted(row.items(), key=lambda item: item[1].logprob, reverse=True)[:num]
    return {chosen: row[chosen], **dict(best)}


def _beam_prompt(tokens: list[int], cache_salt: str | None) -> dict:
    prompt = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt
