"""Output processor and detokenizer, driven by hand-built engine-core outputs (no model)."""

import numpy as np
import pytest

from jengine.engine.detokenizer import IncrementalDetokenizer
from jengine.engine.output_processor import OutputProcessor
from jengine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from jengine.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.tiny_model import make_tokenizer

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _run(tokenizer, params, kind, token_ids, *, finish=None, stop_reason=None, step=1):
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hark:")
    [sequence] = processor.add_request(
        EngineCoreRequest("r", prompt, params), "Hark:", output_kind=kind
    )
    outputs, aborted = [], []
    for i in range(0, len(token_ids), step):
        last = i + step >= len(token_ids)
        core = EngineCoreOutput(
            sequence.request_id,
            token_ids[i : i + step],
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        )
        processed = processor.process_outputs([core])
        outputs += processed.request_outputs
        aborted += processed.reqs_to_abort
        abort = processed.reqs_to_abort
        if abort:
            break
    return outputs, aborted, processor


@pytest.mark.parametrize("detokenize", [True, False])
def test_detokenize_false_gives_no_text_and_no_decoded_tokens(tokenizer, detokenize):
    """vLLM's detokenize=False: tokens and logprobs without any text, the logprobs'
    decoded_token included (the tokenizer decoded every top token of every row)."""
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hark:")
    params = SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1, detokenize=detokenize)
    [sequence] = processor.add_request(EngineCoreRequest("r", prompt, params), "Hark:")
    ids = tokenizer.encode(" winter of")[:2]

    def rows(tokens: list[int]) -> LogprobsLists:
        return LogprobsLists([[t, t + 1] for t in tokens], [[-0.5, -1.0]] * len(tokens),
                             [1] * len(tokens))  # fmt: skip

    core = EngineCoreOutput(
        sequence.request_id,
        ids,
        new_logprobs=rows(ids),
        new_prompt_logprobs=rows(prompt[1:]),
        finish_reason=FinishReason.LENGTH,
    )
    [output] = processor.process_outputs([core]).request_outputs
    completion = output.outputs[0]
    assert completion.token_ids == ids
    assert (completion.text != "") == detokenize
    top = [
        (token_id, logprob.decoded_token)
        for row in completion.logprobs + output.prompt_logprobs[1:]
        for token_id, logprob in row.items()
    ]
    assert len(top) == 2 * (len(ids) + len(prompt) - 1)
    for token_id, text in top:
        assert text == (tokenizer.decode([token_id]) if detokenize else None)


def test_incremental_text_equals_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    outputs, _, _ = _run(
        tokenizer, SamplingParams(), RequestOutputKind.DELTA, ids, finish=FinishReason.LENGTH
    )
    assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(ids)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    final, _, _ = _run(
        tokenizer,
        SamplingParams(),
        RequestOutputKind.FINAL_ONLY,
        ids,
        finish=FinishReason.LENGTH,
        step=3,
    )
    assert len(final) == 1 and final[0].outputs[0].text == tokenizer.decode(ids)
    assert final[0].outputs[0].token_ids == ids


def test_text_that_stops_being_monotonic_decodes_on(tmp_path):
    """A byte-fallback tokenizer (Llama 2's, Mistral's kind): a lone byte, an incomplete
    UTF-8 lead byte, then a word. tokenizers' DecodeStream raised "Invalid prefix
    encountered" there, which failed the request (a 500 over HTTP); the window method
    takes over and the text goes on, the word and the words after it as decode gives
    them, and valid UTF-8 spelled in byte pieces decodes exactly."""
    from transformers import AutoTokenizer

    from tests.engine.tokenizer_kinds import save_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer("sentencepiece-style", str(tmp_path)))
    words = tokenizer.encode(" winter of our discontent", add_special_tokens=False)
    lone = tokenizer.convert_tokens_to_ids(["<0x0A>", "<0xF0>"])
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Now is"), SamplingParams())
    for token_id in [*lone, *words]:
        detokenizer.update([token_id])
    assert detokenizer.text.endswith(tokenizer.decode(words[1:]))
    assert detokenizer.num_output_tokens == len(lone) + len(words)
    spelled = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in " café 日本".encode()])
    prompt = tokenizer.encode("Now is")
    exact = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for token_id in spelled + words:
        exact.update([token_id])
    whole, head = tokenizer.decode(prompt + spelled + words), tokenizer.decode(prompt)
    assert exact.text == whole[len(head) :] and exact.text.startswith(" café 日本 ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_aborts(tokenizer, include):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["summer"], include_stop_str_in_output=include)
    outputs, aborted, processor = _run(tokenizer, params, RequestOutputKind.DELTA, ids)
    text = "".join(o.outputs[0].text for o in outputs)
    full = tokenizer.decode(ids)
    cut = full.index("summer") + (len("summer") if include else 0)
    assert text == full[:cut]
    assert aborted == ["r-0"] and not processor.has_unfinished_requests()
    assert outputs[-1].outputs[0].finish_reason == "stop"
    assert outputs[-1].outputs[0].stop_reason == "summer"


@pytest.mark.parametrize("step", [1, 4])
def test_a_stop_string_the_last_token_completes_is_a_stop(tokenizer, step):
    """The core ends a request for its length on the token that completes a stop string
    (alone, or among several a step brings): as vLLM, the reason is the stop string,
    the text is cut there, and nothing goes back to the core to abort."""
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids)
    completing = next(n for n in range(1, len(ids) + 1) if "summer" in tokenizer.decode(ids[:n]))
    params = SamplingParams(stop=["summer"], max_tokens=completing + step - 1)
    length = (completing + step - 1) // step * step  # the core's last step ends there
    final, aborted, _ = _run(
        tokenizer, params, RequestOutputKind.FINAL_ONLY, ids[:length], finish=FinishReason.LENGTH,
        step=step,
    )  # fmt: skip
    completion = final[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "summer")
    assert completion.text == full[: full.index("summer")]
    assert completion.token_ids == ids[:completing] and not aborted


def test_stream_never_shows_a_stop_string_it_takes_back(tokenizer):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["glorious summer"])
    outputs, _, _ = _run(tokenizer, params, RequestOutputKind.DELTA, ids)
    seen = ""
    for o in outputs:
        seen += o.outputs[0].text
        assert "glorious" not in seen


def test_stop_token_text_excluded_but_id_kept(tokenizer):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(stop_token_ids=[ids[-1]])
    final, _, _ = _run(
        tokenizer,
        params,
        RequestOutputKind.FINAL_ONLY,
        ids,
        finish=FinishReason.STOP,
        stop_reason=ids[-1],
    )
    completion = final[0].outputs[0]
    assert completion.token_ids == ids
    assert completion.text == tokenizer.decode(ids[:-1])
    assert completion.stop_reason == ids[-1]


def test_min_tokens_delays_stop_strings(tokenizer):
    """As vLLM's: a stop string counts only when a token past the first min_tokens
    completes it (its text is cut, so an earlier one would leave fewer)."""
    ids = tokenizer.encode(TEXT)
    ends = next(k for k in range(1, len(ids)) if "winter" in tokenizer.decode(ids[:k]))
    for min_tokens, finish_reason in ((ends - 1, "stop"), (ends, "length")):
        params = SamplingParams(stop=["winter"], min_tokens=min_tokens, max_tokens=len(ids))
        final, _, _ = _run(
            tokenizer, params, RequestOutputKind.FINAL_ONLY, ids, finish=FinishReason.LENGTH
        )
        assert final[0].outputs[0].finish_reason == finish_reason, min_tokens


def test_n_children_gathered_in_order(tokenizer):
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hark:")
    sequences = processor.add_request(
        EngineCoreRequest("p", prompt, SamplingParams(n=2)), "Hark:", RequestOutputKind.FINAL_ONLY
    )
    assert [s.request_id for s in sequences] == ["0_p-0", "1_p-0"]
    a, b = tokenizer.encode("winter"), tokenizer.encode("summer")
    out = processor.process_outputs(
        [EngineCoreOutput("1_p-0", b, finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    assert out == []  # FINAL_ONLY waits for every child
    out = processor.process_outputs(
        [EngineCoreOutput("0_p-0", a, finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    assert [c.text for c in out[0].outputs] == [tokenizer.decode(a), tokenizer.decode(b)]
    assert [c.index for c in out[0].outputs] == [0, 1] and out[0].request_id == "p"


def test_decode_stream_gives_the_python_methods_text(tokenizer):
    """The Rust DecodeStream fast path and the two-decode Python method agree token by
    token, on random ids (partial UTF-8 bytes, special tokens) as on text."""
    rng = np.random.default_rng(0)
    sequences = [tokenizer.encode(TEXT)] + [
        rng.integers(0, len(tokenizer), 40).tolist() for _ in range(50)
    ]
    used_stream = 0
    for skip_special_tokens in (True, False):
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        for ids in sequences:
            prompt, output = ids[:8], ids[8:]
            fast = IncrementalDetokenizer(tokenizer, prompt, params)
            slow = IncrementalDetokenizer(tokenizer, prompt, params)
            slow.stream = None
            used_stream += fast.stream is not None
            for token_id in output:
                fast.update([token_id])
                slow.update([token_id])
                assert fast.text == slow.text
    # Only prompt contexts that end mid-character keep the Python method.
    assert used_stream > len(sequences)


def test_an_id_used_again_after_an_abort_gets_none_of_the_old_requests_outputs(tokenizer):
    """A client that abandons a request and at once sends another under its id: what the
    engine core sent for the first before the abort reached it is dropped, not put in
    front of the second's tokens (each registration has an engine-core id of its own)."""
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hark:")

    def add():
        request = EngineCoreRequest("r", prompt, SamplingParams())
        [sequence] = processor.add_request(request, "Hark:", RequestOutputKind.DELTA)
        return sequence.request_id

    first = add()
    assert processor.abort_requests(["r"]) == [first]
    second = add()
    assert second != first
    old, new = tokenizer.encode(" winter"), tokenizer.encode(" summer")
    outputs = processor.process_outputs(
        [EngineCoreOutput(first, old), EngineCoreOutput(second, new)]
    ).request_outputs
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [("r", new)]
