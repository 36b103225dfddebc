"""Prompts in: text, token ids or chat messages -> a validated `EngineCoreRequest`.

Where it sits: first thing `LLMEngine.add_request` and `AsyncLLM.generate` do, in the
front-end process (it never imports jax). Promises a clear ValueError, before anything
reaches the engine core, for: an empty prompt, a prompt longer than `max_model_len`,
token ids outside the vocabulary, a text prompt with no tokenizer, logprob counts above
the engine's limit, a structured-output constraint the grammar library rejects, and
work the engine's runner does not do (PoolingParams for a generating engine, SamplingParams
for an embedding one, `dimensions` the model does not allow).
"""

import hashlib
import os
import time

from jengine.config import EngineConfig
from jengine.core import structured_output
from jengine.engine.template_messages import ContentPartError, template_message
from jengine.engine.tokenizer import eos_token_ids_of
from jengine.lora_request import LoRARequest
from jengine.pooling import PoolerConfig, PoolingParams
from jengine.protocol import EngineCoreRequest
from jengine.sampling_params import (
    MAX_LOGPROBS,
    MAX_SUPPRESSED_IDS,
    SamplingParams,
    StructuredOutputsParams,
)

PromptType = str | list[int] | dict
# An embedding request's sampling: the one token that ends its prompt's step, never shown.
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
# What `render_chat` sets itself; `chat_template_kwargs` may not.
_TEMPLATE_RESERVED = {"tokenize", "add_generation_prompt", "continue_final_message"}


class InputProcessor:
    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer, vocab_size: int) -> "InputProcessor":
        return cls(
            tokenizer,
            config.scheduler.max_model_len,
            vocab_size,
            eos_token_ids=eos_token_ids_of(config.model.model, tokenizer),
            serves_lora=config.lora is not None,
            pooler=config.model.pooler,
            priority_scheduling=config.scheduler.policy == "priority",
            max_logprobs=config.model.num_top_logprobs(vocab_size),
        )

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int] = (),
        serves_lora: bool = False,
        pooler: PoolerConfig | None = None,
        priority_scheduling: bool = False,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        if not eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        # Further EOS ids end a request like stop tokens do (unless ignore_eos).
        self.extra_eos_ids = list(eos_token_ids[1:])
        self._valid_specs: set[tuple] = set()
        self.serves_lora = serves_lora
        self.pooler = pooler
        self.priority_scheduling = priority_scheduling
        self.max_logprobs = max_logprobs

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, token-id list or vLLM-style dict."""
        if isinstance(prompt, dict):
            if unknown := sorted(prompt.keys() - _PROMPT_KEYS):
                raise ValueError(
                    f"prompt dicts take {sorted(_PROMPT_KEYS)}, not {unknown} (this engine "
                    "runs text models on token prompts: no images, audio or embeddings)"
                )
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(_unicode(prompt, "prompt"))
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> tuple[str, list[int]]:
        """Chat messages -> (prompt text, token ids) through `chat_template` (a Jinja
        template; default: the model's own), as vLLM renders them: `tools` and
        `chat_template_kwargs` reach the template, and `continue_final_message` leaves the
        last message open for the reply to continue. The template writes the special tokens
        it wants (BOS), so none are added by default. Every problem is a ValueError whose
        message starts with the argument it is about, where there is one."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "this model's tokenizer has no chat template; give one (--chat-template)"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        template_kwargs = dict(chat_template_kwargs or {})
        if reserved := sorted(_TEMPLATE_RESERVED & template_kwargs.keys()):
            raise ValueError(f"chat_template_kwargs may not set {reserved}")
        if tools:
            template_kwargs["tools"] = tools
        rendered = []
        for index, message in enumerate(messages):
            try:
                rendered.append(template_message(message))
            except ContentPartError as e:
                raise ValueError(f"messages[{index}].content[{e.index}]: {e}") from None
        try:
            text = self.tokenizer.apply_chat_template(
                rendered,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                chat_template=chat_template,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise ValueError(f"could not apply the chat template: {e}") from e
        text = _unicode(text, "messages")
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def validate_priority(self, priority: int) -> None:
        """A priority other than 0 only means something to a priority scheduler; under
        first come, first served it is refused (as vLLM does), not silently ignored."""
        if priority != 0 and not self.priority_scheduling:
            raise ValueError(
                f"priority {priority} needs priority scheduling: start the engine with "
                "--scheduling-policy priority (scheduling_policy='priority')"
            )

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.validate_tokens(token_ids)
        self.validate_params(params)

    def validate_tokens(self, token_ids: list[int]) -> None:
        """An empty prompt, one longer than max_model_len, ids outside the vocabulary."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt (length {len(token_ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}"
            )
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are out of vocabulary (the vocabulary has "
                f"{self.vocab_size} tokens)"
            )

    def validate_params(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and self._num_logprobs(value) > self.max_logprobs:
                asked = f" (the whole vocabulary, {self.vocab_size})" if value == -1 else ""
                raise ValueError(
                    f"{name}={value}{asked} exceeds the maximum of {self.max_logprobs} "
                    "(the engine's max_logprobs)"
                )
        bias = params.logit_bias or {}
        bad_bias = [t for t in bias if not 0 <= int(t) < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are out of vocabulary")
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params.structured_outputs)
        bad_allowed = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad_allowed:
            raise ValueError(f"allowed_token_ids {bad_allowed[:5]} are out of vocabulary")
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)

    def _num_logprobs(self, value: int) -> int:
        """A request's logprob count: -1 is the whole vocabulary."""
        return self.vocab_size if value == -1 else value

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it starts the text and, where that spells it with other
        tokens of the same count, after a space (vLLM's rule)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer")
        sequences = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:  # the vocabulary cannot spell it: nothing to ban
                continue
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        bad = [t for words in sequences for t in words if t >= self.vocab_size]
        if bad:
            raise ValueError(f"bad_words spell token ids {bad[:5]} outside the vocabulary")
        return sequences

    def _validate_structured_outputs(self, constraint: StructuredOutputsParams) -> None:
        """The grammar library checks the constraint here, before anything is sent (valid
        specs are remembered: agents send the same schema over and over)."""
        key = structured_output.spec_key(constraint)
        if key in self._valid_specs:
            return
        structured_output.validate(constraint)
        if len(self._valid_specs) >= 1024:
            self._valid_specs.clear()
        self._valid_specs.add(key)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """`params`: SamplingParams to generate, PoolingParams to embed (an engine runs
        one or the other: `--runner`)."""
        pooling_params = None
        truncate_prompt_tokens = params.truncate_prompt_tokens
        if isinstance(params, PoolingParams):
            if self.pooler is None:
                raise ValueError(
                    "embeddings need an embedding engine: start it with --runner pooling "
                    "(runner='pooling')"
                )
            pooling_params = params.verified(self.pooler)
            params = _POOLING_SAMPLING
        elif self.pooler is not None:
            raise ValueError(
                "this engine runs --runner pooling: it embeds (LLM.embed, /v1/embeddings) "
                "and generates nothing"
            )
        if lora_request is not None and not self.serves_lora:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} asked of an engine that does not "
                "serve LoRA adapters (start it with --enable-lora / enable_lora=True)"
            )
        self.validate_priority(priority)
        text, token_ids = self.tokenize(prompt)
        kept = last_prompt_tokens(token_ids, truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(token_ids):  # the text no longer spells the prompt
            text, token_ids = None, kept
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
            # The engine keys every block by the salt: a digest keeps that cost (and the
            # message) the same whatever the salt's length.
            cache_salt = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
        self.validate(token_ids, params)
        missing = [t for t in self.extra_eos_ids if t not in params.stop_token_ids]
        if missing and not params.ignore_eos:
            params = params.clone()
            params.stop_token_ids = [*params.stop_token_ids, *missing]
        suppressed = params.min_tokens_suppressed_ids(self.eos_token_id)
        if len(suppressed) > MAX_SUPPRESSED_IDS:
            raise ValueError(
                f"min_tokens holds back at most {MAX_SUPPRESSED_IDS} token ids from ending "
                f"a request (EOS, the model's other EOS ids and stop_token_ids); this one "
                f"has {len(suppressed)}: give fewer stop_token_ids, or no min_tokens"
            )
        if -1 in (params.logprobs, params.prompt_logprobs):  # the engine counts them
            params = params.clone()
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(params, name) is not None:
                    setattr(params, name, self._num_logprobs(getattr(params, name)))
        return text, EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            lora_request=lora_request,
            pooling_params=pooling_params,
            cache_salt=cache_salt,
        )


def check_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> None:
    """`truncate_prompt_tokens` is None, -1 or from 1 to max_model_len (vLLM's range)."""
    value = truncate_prompt_tokens
    if value is not None and not (value == -1 or 1 <= value <= max_model_len):
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or from 1 to max_model_len ({max_model_len}), "
            f"got {value!r}"
        )


def last_prompt_tokens(
    token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the last
    max_model_len; None: all of them)."""
    check_truncation(truncate_prompt_tokens, max_model_len)
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return token_ids if keep is None else token_ids[-keep:]


# A template has at least one of these; a file name, none (vLLM's rule).
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template`'s value -> the Jinja template: the text of a file, or the value
    itself when it looks like a template. A ValueError for a name that is neither."""
    if template is None:
        return None
    if any(char in template for char in _TEMPLATE_CHARS):
        return template
    try:
        with open(os.path.expanduser(template)) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"chat template {template!r} is neither a file nor a template: {e}") from e


# What a vLLM-style prompt dict may hold here (vLLM's multi_modal_data, prompt_embeds, ...
# are refused by name: silently dropped, the prompt would run without them).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _unicode(text: str, what: str) -> str:
    """`text`, refused if it holds a lone UTF-16 surrogate ("\\ud800"): Python strings may,
    but no tokenizer takes one (a TypeError deep inside `tokenizers` otherwise)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone UTF-16 surrogate at character {e.start}, which is not a "
            "Unicode character"
        ) from None
    return text
