"""How the engine's logprobs read in OpenAI's responses: token strings, the top
candidates of a position, vLLM's prompt_logprobs entries, and -inf clamped for JSON.

Where it sits: each serving layer (serving_engine.py's `OpenAIServing.logprob_format`)
hands it the `Logprob` rows of a `RequestOutput`; the chat route's logprobs object is built
here (`chat`), the completion route shapes what it returns into its own.
"""

import math

from jengine.engine.token_bytes import byte_decoder, piece_bytes
from jengine.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs
from jengine.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from jengine.outputs import Logprob, RequestOutput


class LogprobFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: tokens are written "token_id:<id>"
        self.alphabet = byte_decoder()

    def token_str(self, token_id: int, logprob: Logprob | None = None, as_id: bool = False) -> str:
        """A logprob entry's token: its text, or "token_id:<id>" (`as_id`: vLLM's
        return_tokens_as_token_ids; also without a tokenizer)."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int, token: str) -> list[int]:
        """OpenAI's `bytes` of a logprob entry whose text is `token`: the token's own UTF-8
        bytes, so that a character split over tokens joins again from its tokens' bytes.
        Such a token's text holds U+FFFD, so its bytes come from its vocabulary piece (a
        byte-level or byte-fallback one), when that piece decodes to the very same text."""
        if "\ufffd" in token and self.tokenizer is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            spelled = piece_bytes(piece, self.alphabet) if isinstance(piece, str) else None
            if spelled is not None and spelled.decode("utf-8", "replace") == token:
                return list(spelled)
        return list(token.encode("utf-8", errors="replace"))

    def prompt_logprobs(self, output: RequestOutput, num: int | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` field of a response asking for `num` of them: each
        prompt position's own token and its `num` most likely (the engine may hold more
        when echo asked for more logprobs; -1: all it holds, the whole vocabulary)."""
        if num is None or output.prompt_logprobs is None:
            return None

        def entries(own: int, row: dict[int, Logprob]) -> dict[int, PromptLogprob]:
            return {
                token_id: PromptLogprob(
                    logprob=clamp_logprob(entry.logprob),
                    rank=entry.rank,
                    decoded_token=self.token_str(token_id, entry),
                )
                for token_id, entry in row.items()
                if token_id == own or num == -1 or (entry.rank is not None and entry.rank <= num)
            }

        rows = zip(output.prompt_token_ids, output.prompt_logprobs, strict=True)
        return [None if row is None else entries(own, row) for own, row in rows]

    def top_logprobs(
        self, row: dict[int, Logprob], num: int, as_ids: bool = False
    ) -> list[tuple[int, str, float]]:
        """The `num` most likely candidates of one position as (token id, token, logprob)."""
        return [
            (
                candidate_id,
                self.token_str(candidate_id, candidate, as_ids),
                clamp_logprob(candidate.logprob),
            )
            for candidate_id, candidate in top_k_of(row, num)
        ]

    def chat(
        self,
        token_ids: list[int],
        rows: list[dict[int, Logprob]] | None,
        num: int,
        as_ids: bool = False,
    ) -> ChatCompletionLogProbs:
        """The chat route's logprobs of `token_ids`: each token's own, its bytes and its
        `num` top candidates."""
        content = []
        for token_id, row in zip(token_ids, rows or [], strict=False):
            chosen = row.get(token_id)
            token = self.token_str(token_id, chosen, as_ids)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                    bytes=self.token_bytes(token_id, token),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=candidate,
                            logprob=logprob,
                            bytes=self.token_bytes(candidate_id, candidate),
                        )
                        for candidate_id, candidate, logprob in self.top_logprobs(row, num, as_ids)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)


def top_k_of(row: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely candidates of one position (rank order; the chosen token appears
    only if it is among them); k = -1: the whole vocabulary's."""
    ranked = sorted(row.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return ranked if k == -1 else ranked[:k]


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI and vLLM report -9999.0 for impossible tokens.
    return max(value, -9999.0) if not math.isnan(value) else -9999.0
