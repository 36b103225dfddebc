"""Speculative decoding's configuration (vLLM's `--speculative-config` JSON), read as vLLM
reads it. Where it sits: `EngineConfig.speculative`, built by `engine/arg_utils.py`; the
scheduler (n-gram lookup) and the runner (draft model) read it. Jax-free."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from jengine.config_checks import check_number_types
from jengine.config_checks import require as _require


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` JSON).

    method: "ngram" (prompt lookup over the request's own tokens; jengine/core/
        ngram_proposer.py) or "draft_model" (a smaller model with the same tokenizer);
        None: "draft_model" if a model is named, else "ngram" (as vLLM infers it).
    num_speculative_tokens: drafts proposed per step for each decoding request (k).
    prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first (1 to 3
        when neither is given; one given alone is the other too, as vLLM's).
    model: the draft model's checkpoint (draft_model only).
    disable_by_batch_size: no speculation while more requests than this run (None: always).
    """

    method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        # `"num_speculative_tokens": 2.5` was taken, and ended the engine at its first step.
        check_number_types(self, "speculative_config.")
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = 1, 3
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)
        _require(
            self.method in ("ngram", "draft_model"),
            "speculative_config.method",
            'must be "ngram" or "draft_model"',
            self.method,
        )
        _require(
            self.num_speculative_tokens >= 1,
            "speculative_config.num_speculative_tokens",
            "must be >= 1",
            self.num_speculative_tokens,
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config.prompt_lookup_min",
            f"must be in [1, prompt_lookup_max={self.prompt_lookup_max}]",
            self.prompt_lookup_min,
        )
        _require(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 2,
            "speculative_config.disable_by_batch_size",
            "must be >= 2 (vLLM's bound; below, nothing would speculate)",
            self.disable_by_batch_size,
        )
        _require(
            (self.model is not None) == (self.method == "draft_model"),
            "speculative_config.model",
            "is needed for method draft_model, and only for it",
            self.model,
        )

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI flag), an instance or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        _require(isinstance(value, dict), "speculative_config", "must be a JSON object", value)
        unknown = set(value) - {f.name for f in fields(cls)}
        _require(not unknown, "speculative_config", "has unknown keys", sorted(unknown))
        return cls(**value)
