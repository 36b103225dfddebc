"""LoRA adapters served by the engine (`--enable-lora`, `lora_request`, `add_lora`) against
transformers + PEFT on the random-weight adapters of tests/models/lora_files.py:

- three adapters and the base model mixed in one engine with two adapter slots (so slots
  are evicted and adapters written again), under chunked prefill, prefix caching and
  preemption, on the CPU kernel: each request's greedy tokens are PEFT's for its own
  adapter and its logprobs within 1e-4; nothing compiles after warmup;
- the prefix cache never shares blocks between adapters: the same prompt under a second
  adapter computes every token, under the same adapter again it hits, under another
  adapter added with a removed one's id it misses;
- an adapter trained in JAX is handed over as arrays (`add_lora`), served, replaced and
  removed without a recompile;
- what cannot be served is a ValueError naming it, and leaves the engine serving."""

import shutil

import numpy as np
import pytest

from jengine import LLM, SamplingParams
from jengine.lora_request import LoRARequest
from jengine.models.lora import read_peft_adapter
from tests.engine.engine_helpers import hf_teacher_forced, random_prompts
from tests.models.lora_files import ADAPTERS, peft_model, write_base_and_adapters

# Chunked prefill (16-token budget), prefix hits (a shared 32-token head), preemption
# (13 usable blocks of 16 tokens for up to 6 requests of up to ~80 tokens).
ENGINE = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=6,
    max_num_batched_tokens=16,
    block_size=16,
    num_gpu_blocks_override=14,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=16,
)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    return write_base_and_adapters(tmp_path_factory.mktemp("lora-engine"))


@pytest.fixture(scope="module")
def llm(base_and_adapters):
    return LLM(base_and_adapters[0], **ENGINE)


@pytest.fixture(scope="module")
def hf(base_and_adapters):
    return peft_model(*base_and_adapters)


def _requests(paths) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, paths[name]) for i, name in enumerate(ADAPTERS, start=1)}


def _generate(llm, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, ids)]
        for o, ids in zip(outputs, tokens)
    ]
    return tokens, logprobs, outputs


def _assert_equals_peft(hf, prompts, names, tokens, logprobs):
    for prompt, name, ours, our_logprobs in zip(prompts, names, tokens, logprobs, strict=True):
        if name is None:
            with hf.disable_adapter():
                theirs, their_logprobs = hf_teacher_forced(hf, prompt, ours)
        else:
            hf.set_adapter(name)
            theirs, their_logprobs = hf_teacher_forced(hf, prompt, ours)
        assert ours == theirs, name
        np.testing.assert_allclose(our_logprobs, their_logprobs, atol=1e-4, rtol=0)


def test_adapters_and_the_base_mixed_equal_peft(llm, hf, base_and_adapters):
    _, paths = base_and_adapters
    loras = _requests(paths)
    head = random_prompts(1, seed=11, low=32, high=33)[0]
    prompts = [head + tail for tail in random_prompts(8, seed=12, low=4, high=40)]
    names = [*ADAPTERS, None, *ADAPTERS, None]
    tokens, logprobs, outputs = _generate(
        llm, prompts, [None if n is None else loras[n] for n in names]
    )
    core = llm.engine_core
    assert core.num_preemptions > 0, "no preemption was forced"
    assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
    # Two slots for three adapters: some adapter was evicted and written again.
    assert core.runner.lora.num_loads > len(ADAPTERS)
    assert core.compiles_after_warmup() == 0
    # The adapters matter: the base model's tokens differ from each adapter's.
    assert len({tuple(tokens[i]) for i in range(4)}) == 4
    _assert_equals_peft(hf, prompts, names, tokens, logprobs)


def test_the_prefix_cache_keeps_adapters_apart(llm, base_and_adapters):
    _, paths = base_and_adapters
    loras = _requests(paths)
    prompt = random_prompts(1, seed=21, low=40, high=41)[0]
    runs = [loras["attn-r4"], loras["mlp-r8"], loras["attn-r4"], None]
    cached = [_generate(llm, [prompt], [lora])[2][0].num_cached_tokens for lora in runs]
    # First under attn-r4: nothing cached; under mlp-r8: nothing (other adapter); under
    # attn-r4 again: its two full blocks; the base model: nothing.
    assert cached == [0, 0, 32, 0]
    # attn-r4 removed, and mlp-r8's folder added under its id: nothing attn-r4 computed
    # serves it (it did: wrong tokens, no error), and it generates what mlp-r8 does.
    assert llm.remove_lora(loras["attn-r4"])
    reused = LoRARequest("reused", loras["attn-r4"].lora_int_id, paths["mlp-r8"])
    tokens, logprobs, (output,) = _generate(llm, [prompt], [reused])
    assert output.num_cached_tokens == 0
    expected_tokens, expected_logprobs, _ = _generate(llm, [prompt], [loras["mlp-r8"]])
    assert tokens == expected_tokens
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-5, rtol=0)
    assert llm.remove_lora(reused)  # the id names attn-r4 again for the tests after this


def test_an_adapter_in_memory_is_served_replaced_and_removed(llm, hf, base_and_adapters):
    """A JAX training loop's adapter: arrays [layers, r, in] and [layers, out, r] per
    target, with its alpha (here: a PEFT adapter's own arrays, so PEFT is the oracle)."""
    base, paths = base_and_adapters
    config = llm.engine_core.runner.lora.model_config
    peft_adapter = read_peft_adapter(paths["mlp-r8"], config)
    rank, alpha = ADAPTERS["mlp-r8"][:2]
    # read_peft_adapter folds alpha / r into B: unfold it, as a training loop holds it.
    weights = {t: (a, b / (alpha / rank)) for t, (a, b) in peft_adapter.weights.items()}
    prompts = random_prompts(2, seed=31, low=10, high=30)
    trained = llm.add_lora("trained", weights, alpha=alpha)
    tokens, logprobs, _ = _generate(llm, prompts, [trained, None])
    _assert_equals_peft(hf, prompts, ["mlp-r8", None], tokens, logprobs)
    # Replaced by the attention adapter's weights under the same name: a new id.
    peft_adapter = read_peft_adapter(paths["attn-r4"], config)
    rank, alpha = ADAPTERS["attn-r4"][:2]
    weights = {t: (a, b / (alpha / rank)) for t, (a, b) in peft_adapter.weights.items()}
    replaced = llm.add_lora("trained", weights, alpha=alpha)
    assert replaced.lora_int_id != trained.lora_int_id
    tokens, logprobs, _ = _generate(llm, prompts, [replaced, replaced])
    _assert_equals_peft(hf, prompts, ["attn-r4", "attn-r4"], tokens, logprobs)
    with pytest.raises(ValueError, match="not registered"):
        _generate(llm, prompts, [trained, None])
    # Not while a request uses it (the message names why, and the request goes on).
    engine = llm.llm_engine
    _, request = engine.input_processor.process(
        "busy", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4), 0,
        lora_request=replaced,
    )  # fmt: skip
    engine.add_processed_request(request, None)
    with pytest.raises(ValueError, match=r"the adapter \(id \d+\) is in use by a request"):
        llm.remove_lora("trained")
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.remove_lora("trained")
    assert not llm.remove_lora("trained")
    assert llm.engine_core.compiles_after_warmup() == 0


def test_what_cannot_be_served_is_named(llm, base_and_adapters, tmp_path):
    base, paths = base_and_adapters
    loras = _requests(paths)
    prompt = [[5, 6, 7]]
    with pytest.raises(ValueError, match="no adapter_config.json"):
        _generate(llm, prompt, [LoRARequest("nowhere", 99, str(tmp_path))])
    llm.add_lora(loras["attn-r4"])  # id 1 is attn-r4's
    with pytest.raises(ValueError, match="is adapter 'attn-r4'"):
        _generate(llm, prompt, [LoRARequest("other", 1, paths["mlp-r8"])])
    with pytest.raises(ValueError, match="A \\[3, r, 64\\]"):
        llm.add_lora("wrong", {"q_proj": (np.zeros((3, 4, 32)), np.zeros((3, 64, 4)))})
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("zero", 0, paths["mlp-r8"])
    small = LLM(base, **{**ENGINE, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1})
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        _generate(small, prompt, [loras["all-r16"]])
    # One slot, one adapter kept read on the host: the first adapter is dropped for the
    # second, read again from its folder, and generates what it did.
    first, _, _ = _generate(small, prompt, [loras["attn-r4"]])
    _generate(small, prompt, [loras["mlp-r8"]])
    assert list(small.engine_core.runner.lora.adapters) == [loras["mlp-r8"].lora_int_id]
    assert _generate(small, prompt, [loras["attn-r4"]])[0] == first
    # Requests in flight keep their adapters read beyond max_cpu_loras: a step never reads
    # a folder, so one that is gone fails the request that names it, not the engine (a
    # step read it and the engine core died).
    gone = tmp_path / "gone"
    shutil.copytree(paths["attn-r4"], gone)
    both = [LoRARequest("gone", 7, str(gone)), loras["mlp-r8"]]
    second = _generate(small, prompt, both[1:])[0]
    assert _generate(small, prompt * 2, both)[0] == first + second
    assert len(small.engine_core.runner.lora.adapters) == 2
    shutil.rmtree(gone)
    assert _generate(small, prompt, [loras["attn-r4"]])[0] == first  # the others dropped
    with pytest.raises(ValueError, match="no adapter_config.json"):
        _generate(small, prompt, both[:1])
    assert _generate(small, prompt, both[1:])[0] == second
    assert not small.engine_core.has_unfinished_requests()
    plain = LLM(base, **{k: v for k, v in ENGINE.items() if "lora" not in k})
    with pytest.raises(ValueError, match="does not serve LoRA adapters"):
        _generate(plain, prompt, [loras["attn-r4"]])
    # Still serving, nothing left behind.
    tokens, _, _ = _generate(llm, prompt, [loras["attn-r4"]])
    assert len(tokens[0]) == MAX_TOKENS
    assert not llm.engine_core.has_unfinished_requests()
