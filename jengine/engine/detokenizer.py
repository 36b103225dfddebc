"""Incremental detokenization and stop strings for one sequence.

Where it sits: the output processor keeps one `IncrementalDetokenizer` per running
sequence and feeds it the new token ids of every step (front-end process, no jax).

Promises:
- the text grows by decoding a short window of recent tokens (the "prefix/read offset"
  method HF streamers and vLLM use), so a step costs O(window), not O(length), and a
  token that ends mid-way through a UTF-8 character adds nothing until it completes;
- with a Rust-backed tokenizer (no clean-up of tokenization spaces) the same method runs
  inside `tokenizers`' `DecodeStream`, one call per token instead of two Python-level
  decodes (~1 us against ~6 us: detokenization was most of a 256-request step's host
  time); a prompt context that ends mid-character keeps the Python method, whose text
  the stream would not reproduce exactly, and so does a sequence whose text stops being
  monotonic (a byte-fallback tokenizer's lone byte, then a word), where the stream raises;
- stop strings are searched only in the newly added text (plus the tail that could start
  a match), once past the first `min_tokens` tokens (as vLLM's: a stop string the
  min_tokens-th token completes does not count); on a match the text is cut before the
  stop string (or after it with `include_stop_str_in_output`);
- `text_delta(finished)` holds back the last len(longest stop) - 1 characters of a
  stream, so a client never sees a stop string it must then take back.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from jengine.sampling_params import SamplingParams

# Prompt tokens decoded as context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.stops = list(params.stop or []) if tokenizer is not None else []
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.token_ids = context  # context + outputs, the decoding window source
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""
        self.sent = 0  # characters already handed out by text_delta
        self.backend, self.stream = self._open_stream(context)

    def _open_stream(self, context: list[int]) -> tuple[Tokenizer | None, DecodeStream | None]:
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (
            not isinstance(backend, Tokenizer)
            or getattr(self.tokenizer, "clean_up_tokenization_spaces", False)
            or "\ufffd" in self._decode(context)
        ):
            return None, None
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in context:
            stream.step(backend, token_id)
        return backend, stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that matched, if any (text is cut there)."""
        if self.tokenizer is None:
            self.num_output_tokens += len(new_token_ids)
            return None
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.num_output_tokens += 1
            added = self._stream_step(token_id) if self.stream is not None else self._window_step()
            if added:
                self.text += added
                stop = self._check_stop(len(added))
                if stop is not None:
                    return stop
        return None

    def _stream_step(self, token_id: int) -> str | None:
        try:
            added = self.stream.step(self.backend, token_id)
        except Exception:
            # tokenizers' "Invalid prefix encountered while decoding stream": a byte-fallback
            # tokenizer's text is not always monotonic (a lone byte, then a word: vLLM issue
            # 17448). The window method takes over from the same offsets.
            self.stream = None
            return self._window_step()
        if added:  # every token so far is in the text: the offsets the window method keeps
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return added

    def _window_step(self) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def _check_stop(self, num_added: int) -> str | None:
        # As vLLM's: only a token past the first min_tokens may complete a stop string.
        if not self.stops or self.num_output_tokens <= self.params.min_tokens:
            return None
        for stop in self.stops:
            # A match must end inside the new text; it may start up to len(stop)-1 before.
            start = max(0, len(self.text) - num_added - len(stop) + 1)
            index = self.text.find(stop, start)
            if index != -1:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.text = self.text[:end]
                return stop
        return None

    def text_delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back a possible stop-string prefix mid-stream."""
        if len(self.text) <= self.sent:  # nothing new (always so without a tokenizer)
            return ""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold_back)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
