"""`POST /tokenize` and `POST /detokenize` (vLLM's extra routes): text or chat messages ->
token ids, and token ids -> text, with the server's own tokenizer and chat template.

Where it sits: routes.py calls it; it never reaches the engine, so it keeps working after
the engine process died. Messages go through the chat serving layer's own conversion and
template (`chat_messages.template_messages`, `OpenAIServingChat.render`), so `/tokenize`
counts exactly the prompt tokens a chat request with the same messages would use.
"""

from jengine.entrypoints.openai.chat_messages import template_messages
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from jengine.entrypoints.openai.serving_chat import OpenAIServingChat
from jengine.entrypoints.openai.serving_engine import OpenAIServing
from jengine.entrypoints.openai.serving_models import ServingModels


class OpenAIServingTokenization(OpenAIServing):
    def __init__(
        self,
        engine,
        models: ServingModels,
        chat: OpenAIServingChat,
    ):
        super().__init__(engine, models)
        self.chat = chat

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        self.require_tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if request.prompt is not None:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            tokens = self.tokenizer.encode(request.prompt, add_special_tokens=special)
        else:
            _, tokens = self.chat.render(
                template_messages(request.messages),
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                bool(request.add_special_tokens),
                request.chat_template,
                [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            )
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.max_model_len,
            tokens=tokens,
            token_strs=self.tokenizer.convert_ids_to_tokens(tokens)
            if request.return_token_strs
            else None,
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.require_tokenizer()
        vocab_size = self.engine.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                f"token ids {bad[:5]} are out of vocabulary (the vocabulary has "
                f"{vocab_size} tokens)",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
