"""Engine-core outputs -> RequestOutputs: detokenize, apply stop strings, gather n > 1.

Where it sits: in the front-end process, after the engine core's step outputs arrive
(`LLMEngine.step`, AsyncLLM's output handler). It keeps one `RequestState` per sequence
the engine core runs, and one `ParentRequest` per user request with n > 1.

Promises:
- a sequence that hits a stop string is finished here (finish_reason "stop",
  stop_reason = the string) and reported in `reqs_to_abort` so the engine core frees it;
- output kinds as in vLLM: CUMULATIVE (whole text so far), DELTA (only what is new; for
  streaming) and FINAL_ONLY (one output when everything is done);
- logprobs in vLLM's shape: one {token_id: Logprob} dict per token, the chosen token
  included, with decoded text; prompt logprobs start with None for the first token;
- a failure while taking in one request's output (detokenizer, stop strings, logprobs)
  ends that request only: it is forgotten, its sequences land in `reqs_to_abort`, and the
  exception is handed back in `failed`; every other request carries on. A sequence the
  engine ended with an error (FinishReason.ERROR: a grammar that could not be built or
  met) fails its request the same way, as `RequestRejectedError` (a ValueError: nothing
  was generated yet, so the request itself is what cannot be served) or
  `RequestFailedError` (it failed mid-way), naming the engine's reason.
"""

import itertools
import time
from dataclasses import dataclass, field

from jengine.engine.detokenizer import IncrementalDetokenizer
from jengine.engine.parallel_sampling import fan_out
from jengine.fault_injection import FaultInjector
from jengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from jengine.pooling import PoolingParams, embedding_of
from jengine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from jengine.sampling_params import RequestOutputKind


class RequestError(Exception):
    """The engine ended a request with an error (FinishReason.ERROR)."""


class RequestRejectedError(RequestError, ValueError):
    """The engine could not serve the request before generating anything (a 400)."""


class RequestFailedError(RequestError, RuntimeError):
    """The engine could not finish the request after it had begun to generate (a 500)."""


@dataclass(slots=True)
class ParentRequest:
    """A user request fanned out into n sequences; its output lists all of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: dict[int, "RequestState"] = field(default_factory=dict)
    metrics: RequestMetrics | None = None
    pooling_params: PoolingParams | None = None  # an embedding request
    lora_name: str | None = None  # the adapter it runs with (None: the base model)

    def finished(self) -> bool:
        # A loop, not all(<generator>): this runs for every output of every step.
        for child in self.children.values():  # noqa: SIM110
            if child.finish_reason is None:
                return False
        return True


@dataclass(slots=True)
class RequestState:
    request_id: str  # the engine core's id (the child's, for n > 1)
    index: int  # which of the parent's n sequences
    parent: ParentRequest
    detokenizer: IncrementalDetokenizer
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    eos_token_id: int | None = None
    pooled: bytes | None = None

    def completion(self, delta: bool) -> CompletionOutput:
        finished = self.finish_reason is not None
        if delta:
            tokens = self.output_token_ids[self.sent_tokens :]
            self.sent_tokens = len(self.output_token_ids)
            logprobs = None
            if self.logprobs is not None:
                logprobs = self.logprobs[self.sent_logprobs :]
                self.sent_logprobs = len(self.logprobs)
            text = self.detokenizer.text_delta(finished)
        else:
            tokens, logprobs, text = (
                list(self.output_token_ids),
                self.logprobs,
                self.detokenizer.text,
            )
        return CompletionOutput(
            self.index,
            text,
            tokens,
            self.cumulative_logprob,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass(slots=True)
class ProcessedOutputs:
    """What one step's engine outputs became."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # engine-core ids ended here (stop strings, failures)
    failed: dict[str, Exception]  # user request id -> why building its output failed


class OutputProcessor:
    def __init__(self, tokenizer, faults: FaultInjector | None = None):
        self.tokenizer = tokenizer
        self.faults = faults
        self.request_states: dict[str, RequestState] = {}  # by engine-core id
        self.parents: dict[str, ParentRequest] = {}  # by the user's id
        self._registrations = itertools.count()

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def in_use(self, request_id: str) -> bool:
        """Whether a request of this id is registered and not yet finished."""
        return request_id in self.parents

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a user request (validated by the input processor); returns the
        engine-core sequences to send: the request under an id of its own (the user's
        with this registration's number), or its n > 1 fan-out. Its outputs are
        `output_kind`'s, by default its sampling params' (an embedding's one final output
        whatever is asked). Raises ValueError if the id is already in use."""
        request_id = request.request_id
        if self.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.pooling_params is not None:
            output_kind = RequestOutputKind.FINAL_ONLY  # an embedding comes whole
        elif output_kind is None:
            output_kind = request.sampling_params.output_kind
        parent = ParentRequest(
            request_id,
            prompt,
            request.prompt_token_ids,
            output_kind,
            metrics=RequestMetrics(arrival_time=request.arrival_time or time.time()),
            pooling_params=request.pooling_params,
            lora_name=request.lora_request.lora_name if request.lora_request else None,
        )
        self.parents[request_id] = parent
        # The engine core knows the request by an id of this registration only: outputs it
        # sent before an abort reached it must not land on a new request of the same id
        # (a client retrying under its own id at once got the abandoned one's tokens).
        request = request.__copy__()
        request.request_id = f"{request_id}-{next(self._registrations)}"
        sequences = fan_out(request)
        for index, sequence in enumerate(sequences):
            params = sequence.sampling_params
            state = RequestState(
                request_id=sequence.request_id,
                index=index,
                parent=parent,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer if params.detokenize else None,
                    sequence.prompt_token_ids,
                    params,
                ),
                num_logprobs=params.logprobs,
                num_prompt_logprobs=params.prompt_logprobs,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                eos_token_id=sequence.eos_token_id,
            )
            parent.children[index] = state
            self.request_states[sequence.request_id] = state
        return sequences

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parents (or sequences) by id; returns the engine-core ids to abort."""
        aborted = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            states = list(parent.children.values()) if parent else []
            if not states and request_id in self.request_states:
                states = [self.request_states[request_id]]
            for state in states:
                if self.request_states.pop(state.request_id, None) is not None:
                    aborted.append(state.request_id)
        return aborted

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.time()
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        failed: dict[str, Exception] = {}
        # Parents to look at after the loop: every non-DELTA one that got an output, and
        # DELTA ones that may just have finished (only a finishing child can finish one).
        touched: dict[str, ParentRequest] = {}
        request_states = self.request_states
        delta = RequestOutputKind.DELTA
        for output in outputs:
            state = request_states.get(output.request_id)
            if state is None:  # aborted meanwhile (or failed earlier in this loop)
                continue
            parent = state.parent
            try:
                self._update(state, output, reqs_to_abort)
            except Exception as e:
                failed[parent.request_id] = e
                reqs_to_abort.extend(self.abort_requests([parent.request_id]))
                touched.pop(parent.request_id, None)
                continue
            metrics = parent.metrics
            if metrics is not None and output.new_token_ids:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            finished = state.finish_reason is not None
            if finished:
                del request_states[state.request_id]
            if parent.output_kind != delta:
                touched[parent.request_id] = parent
            else:
                request_outputs.append(
                    RequestOutput(
                        parent.request_id,
                        parent.prompt,
                        parent.prompt_token_ids,
                        state.prompt_logprobs,
                        [state.completion(True)],
                        finished if len(parent.children) == 1 else parent.finished(),
                        state.num_cached_tokens,
                        parent.metrics,
                    )
                )
                if finished:
                    touched[parent.request_id] = parent
        for parent in touched.values():
            finished = parent.finished()
            if finished:
                self.parents.pop(parent.request_id, None)
                if parent.metrics is not None:
                    parent.metrics.finished_time = now
            if parent.output_kind == RequestOutputKind.CUMULATIVE or (
                parent.output_kind == RequestOutputKind.FINAL_ONLY and finished
            ):
                children = [parent.children[i] for i in sorted(parent.children)]
                request_outputs.append(self._make_output(parent, children))
        if failed:
            failed_ids = set(failed)
            request_outputs = [o for o in request_outputs if o.request_id not in failed_ids]
        return ProcessedOutputs(request_outputs, reqs_to_abort, failed)

    def _update(self, state: RequestState, output: EngineCoreOutput, reqs_to_abort: list[str]):
        """Take one engine-core output into the state: tokens, logprobs, finish, text (a
        stop string found in the text finishes the state and lands in reqs_to_abort)."""
        if self.faults is not None:
            self.faults.check("output", state.parent.request_id)
        if output.finish_reason == FinishReason.ERROR:
            error = output.error or "the engine could not serve the request"
            if state.output_token_ids:
                raise RequestFailedError(error)
            raise RequestRejectedError(error)
        new_token_ids = output.new_token_ids
        state.num_cached_tokens = output.num_cached_tokens
        if state.parent.pooling_params is not None:
            state.pooled = output.pooled
            if output.finish_reason is not None and output.pooled is None:
                raise RequestFailedError("the engine finished an embedding request without one")
        text_token_ids = new_token_ids
        finish_reason = output.finish_reason
        if finish_reason is not None:
            if state.finish_reason is None:
                state.finish_reason = str(FinishReason(finish_reason))
                state.stop_reason = output.stop_reason
            # EOS or a stop token ended it: as vLLM, its text is not part of the output
            # (the id stays in token_ids) unless include_stop_str_in_output. (A completed
            # grammar also ends with "stop", on a token that is part of the output.)
            params = state.detokenizer.params
            if (
                finish_reason == FinishReason.STOP
                and new_token_ids
                and not params.include_stop_str_in_output
                and (
                    new_token_ids[-1] == state.eos_token_id
                    or new_token_ids[-1] in params.stop_token_ids
                )
            ):
                text_token_ids = new_token_ids[:-1]
        num_before = state.detokenizer.num_output_tokens
        stop = state.detokenizer.update(text_token_ids)
        if stop is not None:
            # A stop string wins over the core's reason, as in vLLM: one that the last
            # token a request may have completes is "stop", not "length".
            if finish_reason is None:
                reqs_to_abort.append(state.request_id)
            state.finish_reason, state.stop_reason = "stop", stop
            # Several tokens at once (multi-step decoding, accepted drafts) may go on past
            # the one that completed the stop string: as with one token a step, the output
            # ends with that one.
            new_token_ids = new_token_ids[: state.detokenizer.num_output_tokens - num_before]
        state.output_token_ids.extend(new_token_ids)
        if output.new_logprobs is not None and state.logprobs is not None:
            num = len(new_token_ids)
            rows = self._logprob_dicts(state, output.new_logprobs, state.num_logprobs or 0)
            state.logprobs.extend(rows[:num])
            state.cumulative_logprob += sum(r[0] for r in output.new_logprobs.logprobs[:num])
        if output.new_prompt_logprobs is not None:
            rows = self._logprob_dicts(
                state, output.new_prompt_logprobs, state.num_prompt_logprobs or 0
            )
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None]
            state.prompt_logprobs.extend(rows)

    def _logprob_dicts(
        self, state: RequestState, lists: LogprobsLists, num: int
    ) -> list[dict[int, Logprob]]:
        """Each position's sampled (or prompt) token and its top `num`; their text only
        where the request is detokenized (as vLLM's, decoded_token is None otherwise)."""
        tokenizer = self.tokenizer if state.detokenizer.params.detokenize else None
        decode = tokenizer.decode if tokenizer is not None else (lambda ids: None)
        rows = []
        for ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            row = {ids[0]: Logprob(values[0], rank, decode([ids[0]]))}
            for k in range(1, min(num, len(ids) - 1) + 1):
                row.setdefault(ids[k], Logprob(values[k], k, decode([ids[k]])))
            rows.append(row)
        return rows

    def _make_output(
        self, parent: ParentRequest, children: list[RequestState]
    ) -> RequestOutput | EmbeddingRequestOutput:
        delta = parent.output_kind == RequestOutputKind.DELTA
        first = children[0]
        if parent.pooling_params is not None:
            return EmbeddingRequestOutput(
                parent.request_id,
                EmbeddingOutput(embedding_of(first.pooled, parent.pooling_params)),
                parent.prompt_token_ids,
                num_cached_tokens=first.num_cached_tokens,
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=[c.completion(delta) for c in children],
            finished=parent.finished(),
            num_cached_tokens=first.num_cached_tokens,
            metrics=parent.metrics,
        )
