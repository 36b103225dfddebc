"""Structured outputs: grammars compiled off the step loop, one matcher per constrained
request, and each step's token bitmask.

Where it sits: the front end calls `validate` (through the input processor) so a bad
schema, regex or grammar is a ValueError before anything is sent. In the engine core the
Scheduler hands every constrained request to its `StructuredOutputManager`: the request
waits (vLLM's WAITING_FOR_FSM) while its grammar compiles on a thread pool, then runs
like any other; each step `fill_bitmask` writes the packed int32 bitmask rows
`[rows, ceil(V / 32)]` of the constrained requests that sample in it, which travel to the
runner in the SchedulerOutput (the sampler masks the logits with them on device), and
`accept` feeds each sampled token back to the request's matcher; a matcher that can take
nothing more ends its request with `stop`. A grammar that fails to build, or that this
vocabulary cannot continue (no token fits where the output stands, or a sampled token the
matcher refuses), ends its request with an error naming the cause (FINISHED_ERROR), never
with a quiet empty success. vLLM's `allowed_token_ids` and `bad_words` ride the same rows:
such a request is constrained, with a grammar or without one.

The grammar library is llguidance (vLLM's `guidance` backend): a Rust Earley parser with
no dependency (xgrammar, vLLM's default, requires torch and triton, which jengine
otherwise never installs), JSON schema, regex, Lark and GBNF grammars, and masks computed
lazily per step in microseconds, so a grammar "compiles" in milliseconds. Regexes and JSON
schemas first pass through `constraint_dialect`, so they read as in xgrammar. Jax-free.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from jengine.core.constraint_dialect import ascii_shorthands, closed_objects
from jengine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from jengine.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for requests to come (the least recently used go first).
MAX_COMPILED = 256


class StructuredOutputError(Exception):
    """A constrained request cannot go on; the message is for the client."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def token_bitmask(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """The packed int32 bitmask row with the bits of `token_ids` set."""
    ids = np.asarray(token_ids, np.int64)  # the front end checked them against the vocabulary
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: see `validate`)."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if kind == "json":
            schema = closed_objects(schema)
        # Fixed separators (json.dumps' by default) and no free whitespace: a model cannot
        # pad the output forever.
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if params.disable_any_whitespace:
            options.update(item_separator=",", key_separator=":")
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {e}") from e
    if kind == "regex":
        return LLMatcher.grammar_from_regex(ascii_shorthands(params.regex))
    if kind == "choice":
        return grammar_from("choice", json.dumps(params.choice))
    try:  # a Lark grammar, or GBNF (converted to Lark)
        return grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar is invalid: {e}") from e


def without_forcing(grammar: str) -> str:
    """`grammar` with llguidance's forcing off: normally text the grammar fixes (a JSON
    key, a literal) is tokenized by llguidance and forced as those tokens, which needs a
    tokenizer that spells any text exactly; without it the model samples that text too,
    under the mask. The option applies to nested grammars, so the constraint is wrapped
    as the one grammar a forcing-free Lark grammar refers to."""
    if not grammar.lstrip().startswith("{"):  # Lark text
        grammar = json.dumps({"grammars": [{"name": "constraint", "lark_grammar": grammar}]})
    top = json.loads(grammar)
    inner = top["grammars"][0]
    inner["name"] = inner.get("name") or "constraint"
    wrapper = f'%llguidance {{"no_forcing": true}}\nstart: @{inner["name"]}\n'
    top["grammars"].insert(0, {"name": "no_forcing", "lark_grammar": wrapper})
    return json.dumps(top)


def validate(params: StructuredOutputsParams) -> None:
    """Raise a ValueError naming the problem if llguidance rejects the constraint."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar_for(params))
    if error:
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {error}")


def spec_key(params: StructuredOutputsParams) -> tuple:
    """What identifies a compiled grammar (equal specs share one)."""
    value = getattr(params, params.kind)
    if isinstance(value, dict | list):
        value = json.dumps(value, sort_keys=True)
    return params.kind, value, params.disable_any_whitespace


class StructuredOutputRequest:
    """One request's constraint: its compiling grammar, then its matcher (none without a
    grammar); with a `reasoning_end` marker, free until the output has produced it. Beside
    it, or alone, the token lists: `allowed` (the bitmask row of `allowed_token_ids`) and
    `bad_words` (token sequences whose last token is masked after the ones before it)."""

    __slots__ = ("future", "matcher", "reasoning_end", "reasoning_ended", "allowed", "bad_words")

    def __init__(
        self,
        future: Future | None,
        reasoning_end: str | None = None,
        allowed: np.ndarray | None = None,
        bad_words: list[list[int]] | None = None,
    ):
        self.future = future
        self.matcher = None
        self.reasoning_end = reasoning_end
        self.reasoning_ended = reasoning_end is None
        self.allowed = allowed
        self.bad_words = bad_words or []

    @property
    def ready(self) -> bool:
        """Compiled (or failed); takes the matcher on first success."""
        if self.matcher is not None or self.future is None:
            return True
        if not self.future.done():
            return False
        if self.future.exception() is None:
            self.matcher = self.future.result()
        return True

    @property
    def error(self) -> str | None:
        if self.future is None or not self.future.done():
            return None
        exception = self.future.exception()
        if exception is not None:
            return str(exception)
        return self.matcher.get_error() or None if self.matcher is not None else None


class StructuredOutputManager:
    """Compiles grammars on a thread pool (cached by spec) and keeps each constrained
    request's matcher in step with its tokens."""

    def __init__(
        self,
        make_tokenizer: Callable[[], tuple[object, bool]],
        vocab_size: int,
        max_workers: int = 2,
    ):
        """`make_tokenizer`: builds the `llguidance.LLTokenizer` and says whether it turns
        text into tokens that spell exactly that text (about a second; done on the pool the
        first time a constrained request arrives)."""
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._make_tokenizer = make_tokenizer
        self._tokenizer = None
        self._tokenizes_exactly = True
        self._tokenizer_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        # spec -> compiled matcher (a template), the most recently used last: agents send
        # the same schemas over and over, but every distinct one costs memory (~0.25 MiB
        # for a small schema), so only the last MAX_COMPILED are kept.
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()

    def add_request(self, request: Request) -> None:
        sampling = request.sampling_params
        params = sampling.structured_outputs
        future = reasoning_end = allowed = None
        if params is not None:
            key = spec_key(params)
            template = self._compiled.get(key)
            if template is None:
                template = self._executor.submit(self._compile, params)
                self._compiled[key] = template
                if len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            future = self._executor.submit(self._copy, template)
            reasoning_end = params.reasoning_end
        if sampling.allowed_token_ids is not None:
            allowed = token_bitmask(sampling.allowed_token_ids, self.vocab_size)
        request.structured_output = StructuredOutputRequest(
            future, reasoning_end, allowed, sampling.bad_words_token_ids
        )

    def _tokenizer_once(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer, self._tokenizes_exactly = self._make_tokenizer()
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        tokenizer = self._tokenizer_once()
        grammar = grammar_for(params)
        if not self._tokenizes_exactly:
            grammar = without_forcing(grammar)
        matcher = LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
        return matcher

    @staticmethod
    def _copy(template: Future):
        return template.result().deep_copy()  # a fresh matcher, the compiled grammar shared

    @staticmethod
    def take_compiled(
        waiting: dict[str, Request], idle: bool
    ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Remove the requests whose grammar is done from `waiting`: (compiled, failed with
        why). `idle` (nothing else to run): first wait a little for one instead of spinning."""
        if idle:
            futures = [r.structured_output.future for r in waiting.values()]
            if None not in futures:  # a request without a grammar is ready now
                concurrent.futures.wait(futures, timeout=0.05, return_when="FIRST_COMPLETED")
        compiled, failed = [], []
        for req_id, request in list(waiting.items()):
            constraint = request.structured_output
            if not constraint.ready:
                continue
            del waiting[req_id]
            error = constraint.error
            if error is None:
                compiled.append(request)
            else:
                logger.warning("request %s: its grammar failed: %s", req_id, error)
                failed.append((request, f"the output constraint could not be built: {error}"))
        return compiled, failed

    def fill_bitmask(self, requests: list[Request]) -> np.ndarray:
        """The bitmask rows of these requests (ready ones), in order: bit t % 32 of word
        t // 32 set means token t may come next."""
        from llguidance.numpy import fill_next_token_bitmask

        bitmask = np.full((len(requests), self.width), -1, np.int32)
        bits = bitmask.view(np.uint32)
        for row, request in enumerate(requests):
            constraint = request.structured_output
            # Without reasoning_ended the request is still thinking: free.
            if constraint.matcher is not None and constraint.reasoning_ended:
                fill_next_token_bitmask(constraint.matcher, bitmask, row)
            if constraint.allowed is not None:
                bitmask[row] &= constraint.allowed
            for words in constraint.bad_words:
                before = len(words) - 1
                if before == 0 or list(request.output_token_ids[-before:]) == words[:-1]:
                    word, bit = divmod(words[-1], 32)
                    bits[row, word] &= ~np.uint32(1 << bit)
        return bitmask

    def accept(self, request: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's matcher; True if the grammar is now
        complete (nothing but EOS may follow). StructuredOutputError if the request cannot
        go on: the matcher already failed when it computed the token's mask (no token of
        the vocabulary fits there), or it refuses the token."""
        constraint = request.structured_output
        if constraint.matcher is None:  # token lists only: nothing to advance
            return False
        if not constraint.reasoning_ended:
            # The marker may span tokens: look for it in the last few tokens' text.
            tail = self._tokenizer.decode_str(request.output_token_ids[-16:])
            constraint.reasoning_ended = constraint.reasoning_end in tail
            return False
        matcher = constraint.matcher
        if matcher.is_error() or not matcher.consume_token(token_id):
            error = _first_line(matcher.get_error())
            logger.warning("request %s: its grammar failed: %s", request.request_id, error)
            where = "at its start" if request.num_output_tokens <= 1 else "mid-way"
            raise StructuredOutputError(
                f"the output constraint cannot be met with this model's vocabulary "
                f"({where}: {error})"
            )
        return matcher.is_stopped()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _first_line(error: str) -> str:
    """llguidance's error in words, without its parser-state dump."""
    first = error.split("\n", 1)[0].strip()
    if not first or first == "NoExtensionBias":  # the mask allowed no token but EOS
        return "no token of the vocabulary can continue the output"
    return first
