"""OpenAI's `usage` of a response: token counts, whole or counted as a stream goes.

Where it sits: the serving classes (serving_engine.py and its subclasses) build a full
response's usage with `usage`, and count a stream's with a `StreamUsage` that
`stream_chunks` feeds; `prompt_tokens_details` appears only with
--enable-prompt-tokens-details.
"""

from dataclasses import dataclass, field

from jengine.entrypoints.openai.protocol import PromptTokenUsageInfo, UsageInfo


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> UsageInfo:
    """OpenAI's usage; `prompt_tokens_details` only where `cached_tokens` is given."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=None
        if cached_tokens is None
        else PromptTokenUsageInfo(cached_tokens=cached_tokens),
    )


@dataclass
class StreamUsage:
    """Token counts of a stream so far; `stream_chunks` adds each choice's completion
    tokens (`add`) and notes each prompt's cached tokens (by prompt index)."""

    prompt_lengths: list[int]  # each prompt's tokens
    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)
    with_details: bool = False  # --enable-prompt-tokens-details
    n: int = 1  # choices per prompt: choice i answers prompt i // n
    choice_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())

    def add(self, choice: int, num_tokens: int) -> None:
        self.completion_tokens += num_tokens
        self.choice_tokens[choice] = self.choice_tokens.get(choice, 0) + num_tokens

    def info(self) -> UsageInfo:
        cached = self.num_cached_tokens if self.with_details else None
        return usage(self.prompt_tokens, self.completion_tokens, cached)

    def of_choice(self, choice: int) -> UsageInfo:
        """One choice's usage so far (continuous_usage_stats, as vLLM's): its prompt's
        tokens and its own completion tokens."""
        prompt = choice // self.n
        cached = self.cached_tokens.get(prompt, 0) if self.with_details else None
        return usage(self.prompt_lengths[prompt], self.choice_tokens.get(choice, 0), cached)
