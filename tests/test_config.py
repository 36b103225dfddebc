"""Configs validate on construction, are frozen, and hold the engine's only defaults."""

import dataclasses
import json
import logging
import re

import pytest

from jengine.config import CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig
from jengine.engine.arg_utils import EngineArgs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"num_gpu_blocks": 1}, "num_gpu_blocks"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.1}, "gpu_memory_utilization"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ],
)
def test_cache_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"policy": "lifo"}, "policy"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_scheduler_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SchedulerConfig(**kwargs)


def test_configs_are_frozen():
    cfg = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32
    assert SchedulerConfig(policy="priority").policy == "priority"


def test_engine_args_defaults_are_the_configs():
    """EngineArgs, and so LLM and every CLI flag, take their defaults from jengine.config."""
    args = EngineArgs()
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs
    assert args.long_prefill_token_threshold == SchedulerConfig().long_prefill_token_threshold
    assert args.scheduling_policy == SchedulerConfig().policy
    cache = CacheConfig()
    assert (args.block_size, args.enable_prefix_caching) == (
        cache.block_size,
        cache.enable_prefix_caching,
    )
    assert args.gpu_memory_utilization == cache.gpu_memory_utilization
    assert args.kv_cache_dtype == cache.kv_cache_dtype == "auto"
    model = ModelConfig()
    assert (args.dtype, args.seed, args.attention_impl) == (
        model.dtype,
        model.seed,
        model.attention_impl,
    )
    assert args.compilation_cache_dir == CompilationConfig().cache_dir


def test_engine_args_build_the_config(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 300}')
    config = EngineArgs(
        model=str(tmp_path), long_prefill_token_threshold=32, compilation_cache_dir=None
    ).create_engine_config()
    assert config.scheduler.max_model_len == 300
    assert config.scheduler.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert config.scheduler.long_prefill_token_threshold == 32
    assert config.compilation.cache_dir is None
    # The token budget grows to max_num_seqs when that is larger (one token per request).
    wide = EngineArgs(model=str(tmp_path), max_num_seqs=4096).create_engine_config()
    assert wide.scheduler.max_num_batched_tokens == 4096
    # ... and shrinks to what max_num_seqs requests of max_model_len can use (fewer shapes).
    single = EngineArgs(model=str(tmp_path), max_num_seqs=1).create_engine_config()
    assert single.scheduler.max_num_batched_tokens == 300


def test_max_model_len_past_the_trained_positions_needs_saying_so(tmp_path, monkeypatch):
    """As vLLM: longer than max_position_embeddings is refused (a huge value once crashed
    allocating the batch's token table) unless JENGINE_ALLOW_LONG_MAX_MODEL_LEN=1."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 300}')
    monkeypatch.delenv("JENGINE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert EngineArgs(model=str(tmp_path), max_model_len=300).create_engine_config()
    for too_long in (301, 10**8):
        with pytest.raises(ValueError, match="max_model_len=.* context \\(300: its max_posi"):
            EngineArgs(model=str(tmp_path), max_model_len=too_long).create_engine_config()
    monkeypatch.setenv("JENGINE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = EngineArgs(model=str(tmp_path), max_model_len=301).create_engine_config()
    assert config.scheduler.max_model_len == 301


@pytest.mark.parametrize(
    ("rope", "context"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 1200),  # vicuna-16k's kind
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 600),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 300),  # already scaled
        ({"model_type": "gemma3_text", "rope_scaling": {"type": "linear", "factor": 8}}, 300),
        # YaRN scales its original length (Qwen2.5's 32K x 4 = 128K).
        ({"rope_scaling": {"type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 100}}, 400),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 600),
    ],
)  # fmt: skip
def test_a_linear_rope_scaling_multiplies_the_context(tmp_path, monkeypatch, rope, context):
    """vLLM's reading: positions scaled linearly by a factor serve that many times
    max_position_embeddings (the context was a quarter of a 4x-scaled checkpoint's)."""
    monkeypatch.delenv("JENGINE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 300, **rope}))
    assert EngineArgs(model=str(tmp_path)).create_engine_config().scheduler.max_model_len == context
    with pytest.raises(ValueError, match=f"context \\({context}:"):
        EngineArgs(model=str(tmp_path), max_model_len=context + 1).create_engine_config()


@pytest.mark.parametrize(
    ("rope", "exact"),
    [
        # Phi-3.5-mini's kind: 131072 positions, long factors past 4096 (here 300 / 64).
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
          "original_max_position_embeddings": 64}, 64),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 300),
        # Older Phi-3 128k files call longrope "su" (transformers and vLLM read it so).
        ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
          "original_max_position_embeddings": 64}, 64),
    ],
)  # fmt: skip
def test_a_rope_that_changes_with_length_is_served_where_it_does_not(
    tmp_path, monkeypatch, caplog, rope, exact
):
    """ "longrope" and "dynamic" frequencies depend on the sequence's length in transformers:
    the default context stops where they are fixed, with a warning naming why, and a longer
    max_model_len is refused even with JENGINE_ALLOW_LONG_MAX_MODEL_LEN (outputs past it
    would differ from transformers' with no error)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 300, **rope}))
    monkeypatch.setenv("JENGINE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.WARNING):
        config = EngineArgs(model=str(tmp_path)).create_engine_config()
    assert config.scheduler.max_model_len == exact
    assert f"exact up to {exact} tokens" in caplog.text
    assert EngineArgs(model=str(tmp_path), max_model_len=exact).create_engine_config()
    with pytest.raises(ValueError, match=f"longer than {exact}: its '.*' rope is exact up to"):
        EngineArgs(model=str(tmp_path), max_model_len=exact + 1).create_engine_config()


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_model_len="abc"), dict(max_num_seqs=2.5), dict(block_size=True),
     dict(gpu_memory_utilization="0.5")],
)  # fmt: skip
def test_a_number_of_the_wrong_type_names_its_field(tmp_path, kwargs):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 300}')
    [name] = kwargs
    with pytest.raises(ValueError, match=f"^{name} must be"):
        EngineArgs(model=str(tmp_path), **kwargs).create_engine_config()


def test_speculative_config_that_is_not_json_names_the_flag():
    from jengine.config import SpeculativeConfig

    with pytest.raises(ValueError, match="^speculative_config is not valid JSON"):
        SpeculativeConfig.from_value("{bad")


def test_seed_none_draws_a_seed_per_engine(tmp_path):
    """vLLM's seed=None: unseeded sampling differs between runs (it crashed the first
    unseeded request before); the default 0 keeps it reproducible."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 300}')
    seeds = {EngineArgs(model=str(tmp_path), seed=None).create_engine_config().model.seed
             for _ in range(3)}  # fmt: skip
    assert len(seeds) == 3 and all(isinstance(seed, int) for seed in seeds)
    assert EngineArgs(model=str(tmp_path)).create_engine_config().model.seed == 0


@pytest.mark.parametrize(
    ("value", "error"),
    [
        # Types: a TypeError at start, or taken and the engine's first step died (2.5).
        ('{"num_speculative_tokens": "3"}', "num_speculative_tokens must be an int, got '3'"),
        ('{"num_speculative_tokens": 2.5}', "num_speculative_tokens must be an int, got 2.5"),
        ('{"disable_by_batch_size": "2"}', "disable_by_batch_size must be an int"),
        # Below 2 nothing ever speculated, in silence.
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be >= 2"),
        ("3", "speculative_config must be a JSON object, got 3"),
        # A model for ngram was ignored without a word.
        ('{"method": "ngram", "model": "x"}', "model is needed for method draft_model, and only"),
        ('{"method": "draft_model"}', "model is needed for method draft_model"),
    ],
)
def test_speculative_config_values_of_the_wrong_kind_name_their_field(value, error):
    from jengine.config import SpeculativeConfig

    with pytest.raises(ValueError, match=re.escape(error)):
        SpeculativeConfig.from_value(value)


def test_speculative_config_is_read_as_vllm_reads_it():
    """A model named without a method is a draft model (it ran n-gram lookup, the model
    ignored); one n-gram bound given alone is the other too (min 4 alone was refused)."""
    from jengine.config import SpeculativeConfig

    read = SpeculativeConfig.from_value
    assert read('{"model": "draft"}').method == "draft_model"
    assert read("{}").method == "ngram"
    assert (read("{}").prompt_lookup_min, read("{}").prompt_lookup_max) == (1, 3)
    lookup = read('{"prompt_lookup_min": 4}')
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (4, 4)
    lookup = read('{"prompt_lookup_max": 5}')
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (5, 5)
