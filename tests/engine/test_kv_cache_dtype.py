"""`--kv-cache-dtype` in the engine: an fp8 cache serves every sampling feature under
chunked prefill, prefix-cache hits and preemption with nothing leaked and nothing compiled
after warmup; a memory budget holds four times the float32 cache's tokens, and the
capacity line says the cache's type. (The kernels' reads and writes of fp8 caches are
checked against the reference in tests/kernels; what fp8 costs in perplexity, on SmolLM2
in tests/models/test_smollm2.py.)"""

import argparse
import re

import pytest

from jengine import LLM
from jengine.engine.arg_utils import EngineArgs
from tests.engine.engine_helpers import (
    TIGHT_ENGINE_ARGS,
    assert_engines_clean,
    every_feature_batch,
)
from tests.entrypoints.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_kv_dtype")))


def test_an_fp8_cache_serves_every_feature(tiny_model):
    llm = LLM(tiny_model, kv_cache_dtype="fp8", **TIGHT_ENGINE_ARGS)
    runner = llm.engine_core.runner
    assert runner.kv_cache.dtype.name == "float8_e4m3fn"
    assert "tokens of float8_e4m3fn" in llm.engine_core.capacity_report
    assert re.search(r"\(\d+\.\d MiB\)", llm.engine_core.capacity_report)  # not "0.000 GiB"
    prompts, params = every_feature_batch(seed=0)
    preemptions = llm.engine_core.num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine_core.num_preemptions > preemptions, "no preemption was forced"
    assert sum(o.num_cached_tokens > 0 for o in outputs) > 0, "no prefix-cache hit"
    for output, sampling in zip(outputs, params, strict=True):
        assert len(output.outputs) == sampling.n
        for seq in output.outputs:
            assert seq.finish_reason in ("stop", "length") and seq.token_ids
    assert_engines_clean({"fp8": llm})
    llm.shutdown()


def test_a_budget_holds_four_times_the_tokens_in_fp8(tiny_model):
    budget = 1 << 20
    sized = {**TIGHT_ENGINE_ARGS, "num_gpu_blocks_override": None, "warmup": False}
    blocks = {}
    for name in ("auto", "fp8_e5m2"):
        llm = LLM(tiny_model, kv_cache_dtype=name, kv_cache_memory_bytes=budget, **sized)
        blocks[name] = llm.engine_core.runner.num_blocks
        assert blocks[name] * llm.engine_core.runner.kv_bytes_per_block <= budget
        llm.shutdown()
    assert blocks["fp8_e5m2"] == 4 * blocks["auto"], blocks


def test_the_flag_and_its_refusals():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of auto, bfloat16, fp8"):
        LLM(kv_cache_dtype="fp4")
