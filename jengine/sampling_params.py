"""SamplingParams: how one request wants its tokens chosen and when it wants to stop.

Where it sits: the user (``LLM.generate``, the OpenAI layer) builds one per request; it
travels with the request through the input processor, across the ZMQ boundary to the
engine core, into the scheduler's ``Request`` (stop checks), and to the model runner (the
on-device sampler). The front end uses the string-level fields (``stop``,
``skip_special_tokens``, ...) while detokenizing.

What it promises: names, defaults and meanings follow vLLM's ``SamplingParams``; every
instance that exists has been validated (``__post_init__`` runs on construction *and* on
msgspec decode) and normalized (``stop`` is a list, ``top_k`` 0 means disabled, greedy
requests carry neutral top-p/top-k/min-p), so downstream code never re-checks. It is a
plain-typed ``msgspec.Struct``, so it round-trips through msgpack unchanged.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers

import msgspec

# Below this temperature sampling is greedy (argmax); same threshold as vLLM. The on-device
# sampler (jengine/runner/sampler.py) reads the same constant.
GREEDY_TEMPERATURE_EPS = 1e-5
# The most top logprobs a request may ask for unless the engine was given another
# `max_logprobs` (vLLM's default; `ModelConfig.max_logprobs`).
MAX_LOGPROBS = 20
# How many ids min_tokens can keep from ending a request (EOS and stop_token_ids): the
# on-device sampler masks a fixed-width row of them.
MAX_SUPPRESSED_IDS = 16
_FLOAT_FIELDS = (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p",
)  # fmt: skip


def _require(ok: bool, field: str, msg: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} {msg}, got {value!r}")


def check_truncate_prompt_tokens(value: object) -> None:
    """vLLM's `truncate_prompt_tokens`: None, -1 or a count of tokens >= 1 (the bound by
    max_model_len is the input processor's)."""
    _require(
        value is None
        or (isinstance(value, int) and not isinstance(value, bool) and value >= -1)
        and value != 0,
        "truncate_prompt_tokens",
        "must be -1, an int >= 1 or None",
        value,
    )


class RequestOutputKind(enum.IntEnum):
    """What each output of a request holds (vLLM's names): everything so far, only what is
    new since the last output, or one output when the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the output (vLLM's names); exactly one kind is set.

    json: a JSON schema (dict or JSON text) the output must validate against.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar, in Lark or GBNF (llama.cpp's EBNF) syntax.
    json_object: the output is any JSON object.
    disable_any_whitespace: JSON without spaces (`{"a":1,"b":2}`); by default JSON is
        spaced as `json.dumps` spaces it (`{"a": 1, "b": 2}`), and never more.
    reasoning_end: enforce the constraint only after the output has produced this text
        (the reasoning parser's `</think>`: the model thinks freely, then answers in form).

    The grammar library (llguidance) checks the constraint when the request is made, so a
    bad schema, regex or grammar is a ValueError before anything runs
    (jengine/core/structured_output.py).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if self._set(k)]
        _require(
            len(kinds) == 1,
            "structured_outputs",
            "must set exactly one of json, regex, choice, grammar, json_object",
            kinds,
        )
        if self.choice is not None:
            _require(
                bool(self.choice) and all(isinstance(c, str) for c in self.choice),
                "structured_outputs.choice",
                "must be a non-empty list of strings",
                self.choice,
            )

    def _set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return bool(value) if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        return next(
            k for k in ("json", "regex", "choice", "grammar", "json_object") if self._set(k)
        )


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling and stopping parameters of one request (vLLM semantics).

    n: number of completions to return for the prompt.
    presence_penalty / frequency_penalty: in [-2, 2]; penalize tokens that already appear
        in the output (once / per occurrence).
    repetition_penalty: > 0; divides positive (multiplies negative) logits of tokens seen in
        the prompt or the output; 1.0 disables it.
    temperature: >= 0; below 1e-5 the request is greedy.
    top_p: in (0, 1]; nucleus sampling mass. top_k: 0 or -1 disables it (normalized to 0).
    min_p: in [0, 1]; drop tokens whose probability is below min_p * max probability.
    seed: per-request seed; the same seed and params give the same tokens whatever else
        shares the batch.
    stop: strings that end generation (checked by the front end on detokenized text).
    stop_token_ids: token ids that end generation (checked by the scheduler).
    ignore_eos: keep generating after the EOS token.
    max_tokens: tokens to generate at most; None means until max_model_len.
    min_tokens: EOS and stop_token_ids cannot end generation before this many tokens.
    logprobs: number of top logprobs to return per generated token (plus the sampled one);
        -1: the whole vocabulary's (as vLLM; the engine's max_logprobs must allow it).
    prompt_logprobs: number of top logprobs to return per prompt token (-1 as above).
    logit_bias: token id -> additive bias on the logit.
    include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
    detokenize: detokenization options used by the front end.
    structured_outputs: a constraint on the output (JSON schema, regex, choice, grammar),
        enforced on device by masking the logits before any sampling rule.
    allowed_token_ids: the only token ids the output may have (EOS too only if listed).
    bad_words: words the output may not contain: as vLLM, each word's tokens with and
        without a leading space; the last token of one is masked where the output's last
        tokens are the ones before it. The front end fills `bad_words_token_ids`.
    output_kind: what each output of the request holds (`RequestOutputKind`): the engines'
        `generate` streams by it; `LLM.generate` returns final outputs whatever it says.
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last
        max_model_len); None keeps the whole prompt (a longer one than max_model_len is
        refused). The front end cuts the prompt before anything runs.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = msgspec.field(default_factory=list)
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalize first so validation (and everything downstream) sees one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0  # vLLM accepts both spellings of "disabled"; keep one.
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        for name in _FLOAT_FIELDS:  # a str or None failed in a comparison, not named
            value = getattr(self, name)
            _require(
                isinstance(value, numbers.Real) and not isinstance(value, bool),
                name,
                "must be a number",
                value,
            )
            setattr(self, name, float(value))
        _require(
            self.output_kind in tuple(RequestOutputKind),
            "output_kind",
            "must be a RequestOutputKind",
            self.output_kind,
        )
        self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # Greedy ignores the truncation knobs; neutral values let the runner skip them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", "must be an int >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, "must be in [-2, 2]", value)
        _require(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            "must be a finite number >= 0",
            self.temperature,
        )
        _require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _require(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            "must be -1 or 0 (disabled) or a positive int",
            self.top_k,
        )
        _require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        # 64 bits, as torch's generators take (vLLM's); a larger seed would wrap onto another.
        _require(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            "seed",
            "must be an int of at most 64 bits (from -2**63 to 2**64 - 1)",
            self.seed,
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must contain only non-empty strings",
            self.stop,
        )
        _require(
            self.detokenize or not self.stop,
            "stop",
            "strings are matched on the detokenized text: they need detokenize=True",
            self.stop,
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must contain only ints >= 0",
            self.stop_token_ids,
        )
        if self.max_tokens is not None:
            _require(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                "must be an int >= 1 or None",
                self.max_tokens,
            )
        _require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            "must be an int >= 0",
            self.min_tokens,
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, int) and value >= -1),
                name,
                "must be an int >= 0, -1 (the whole vocabulary) or None",
                value,
            )
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _require(token_id >= 0, "logit_bias", "keys must be token ids >= 0", token_id)
                _require(math.isfinite(bias), "logit_bias", "values must be finite", bias)
        if self.allowed_token_ids is not None:
            _require(
                bool(self.allowed_token_ids)
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids >= 0",
                self.allowed_token_ids,
            )
        if self.bad_words is not None:
            _require(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must contain only non-blank strings",
                self.bad_words,
            )

    @property
    def masks_tokens(self) -> bool:
        """A constraint or token lists that the step's bitmask rows enforce."""
        return (
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def uses_history(self) -> bool:
        """Penalties or a logit bias: the sampler reads the request's token history."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def min_tokens_suppressed_ids(self, eos_token_id: int | None) -> list[int]:
        """The ids masked while the output is short of min_tokens: EOS (unless ignored)
        and the stop token ids, each once."""
        if not self.min_tokens:
            return []
        eos = [] if eos_token_id is None or self.ignore_eos else [eos_token_id]
        return list(dict.fromkeys([*eos, *self.stop_token_ids]))

    def clone(self) -> SamplingParams:
        """A deep copy (the lists and dict are not shared), e.g. one per n-way child."""
        return copy.deepcopy(self)


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM's parameters of `LLM.beam_search` (jengine/beam_search.py): `beam_width` beams
    grown for at most `max_tokens` tokens each; `temperature` 0 takes each beam's top
    2 x beam_width candidates, above 0 its sampled token joins them; `length_penalty`
    ranks the finished beams (cumulative logprob / length ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            _require(ok, name, "must be an int of at least 1", value)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            _require(ok and math.isfinite(value), name, "must be a finite number", value)
        _require(self.temperature >= 0, "temperature", "must be at least 0", self.temperature)
