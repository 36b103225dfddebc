"""JAX research integration: hand LLM a params pytree, generate, swap weights, generate again."""

from flax import nnx

from jengine import SamplingParams
from jengine.models import load_model
from tests.engine.engine_helpers import hf_greedy, make_llm, random_prompts
from tests.models.checkpoints import make_checkpoint


def test_params_pytree_and_update_weights(checkpoint, attention_setup, tmp_path):
    path_a, hf_a = checkpoint
    hf_b = make_checkpoint("llama3", str(tmp_path), seed=1)
    # Weights of B as a plain nested dict of arrays, as a training loop would hold them.
    params_b = nnx.to_pure_dict(nnx.state(load_model(str(tmp_path), "float32"), nnx.Param))
    llm = make_llm(path_a, attention_setup, params=params_b)
    prompts = random_prompts(3, seed=21)
    greedy = SamplingParams(temperature=0, max_tokens=8)

    def run():
        return [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        ]

    assert run() == [hf_greedy(hf_b, p, 8) for p in prompts]
    llm.update_weights(nnx.state(load_model(path_a, "float32"), nnx.Param))
    assert run() == [hf_greedy(hf_a, p, 8) for p in prompts]
    assert llm.engine_core.compiles_after_warmup() == 0


def test_compile_counter_sees_unwarmed_shapes(checkpoint):
    """The zero-compile assertions are only worth something if the counter counts."""
    from jengine.core.sched_output import NewRequestData, SchedulerOutput
    from jengine.runner.model_runner import ModelRunner

    runner = ModelRunner(
        load_model(checkpoint[0], "float32"),
        block_size=4,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_blocks=16,
    )  # no warmup
    params = SamplingParams(temperature=0, max_tokens=2)
    runner.execute(
        SchedulerOutput([NewRequestData("r", [5, 6, 7], params, [1], 0)], [], {"r": 3}, 3)
    )
    assert runner.compiles_after_warmup > 0


def test_bad_params_are_named_and_the_engine_shares_no_buffer(checkpoint):
    """update_weights and LLM(params=) name a missing leaf, one of another shape, one that
    is no array and an integer one where the model holds floats (a missing leaf was once
    kept at its old value, silently); the engine keeps its own copy of the arrays (and
    module) handed over, so deleting them (what a train step that donates them does) or
    editing them in place changes nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from jengine import LLM

    path, hf_model = checkpoint
    params = nnx.to_pure_dict(nnx.state(load_model(path, "float32"), nnx.Param))
    on_device = jax.tree.map(jnp.array, params)
    llm = LLM(path, params=on_device, dtype="float32", max_model_len=32, max_num_seqs=2)
    jax.tree.map(lambda x: x.delete(), on_device)
    prompt = random_prompts(1, seed=22, low=8, high=9)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6)

    def run():
        return llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids

    expected = hf_greedy(hf_model, prompt, 6)
    assert run() == expected
    without_norm = {k: v for k, v in params.items() if k != "norm"}
    narrow = {**params, "layers": {**params["layers"], "k_proj": params["layers"]["k_proj"][:, :8]}}
    integer = {**params, "norm": params["norm"].astype("int32")}
    bad = [
        (without_norm, r"params do not fit the model: missing \['norm'\], unexpected \[\]"),
        (narrow, r"param layers.k_proj has shape \(3, 8, \d+\), expected"),
        (integer, "param norm is int32, the model holds float32"),
        ({**params, "norm": None}, "param norm is a NoneType, not an array"),
        (None, "params must be a dict of arrays"),
    ]  # fmt: skip
    for tree, message in bad:
        with pytest.raises(ValueError, match=f"update_weights: {message}"):
            llm.update_weights(tree)
        assert run() == expected  # nothing changed
    with pytest.raises(ValueError, match="params: param norm is a NoneType, not an array"):
        LLM(path, params={**params, "norm": None}, dtype="float32", max_model_len=32)
    again = jax.tree.map(jnp.array, params)
    llm.update_weights(again)
    jax.tree.map(lambda x: x.delete(), again)
    assert run() == expected
    # Host arrays edited in place after the update, a module's arrays deleted after the
    # engine took it: neither reaches the engine (both did); `dtype` applies to a module.
    on_host = jax.tree.map(np.array, params)
    llm.update_weights(on_host)
    for array in jax.tree.leaves(on_host):
        array *= 0
    assert run() == expected
    module = load_model(path, "float32")
    llm = LLM(module, dtype="float32", max_model_len=32, max_num_seqs=2)
    jax.tree.map(lambda x: x.delete(), nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    assert run() == expected
    narrow = LLM(load_model(path, "float32"), dtype="bfloat16", max_model_len=32, warmup=False)
    assert narrow.engine_core.runner.params["embed_tokens"].value.dtype == "bfloat16"


def test_an_update_while_a_request_runs_leaves_no_stale_prefix(checkpoint, tmp_path):
    """Blocks that hold K/V of the old weights are never a prefix hit after an update,
    those of a request running through it included (they were, silently: the prefix cache
    was kept while any block was in use)."""
    from jengine import LLM

    path, _ = checkpoint
    hf_b = make_checkpoint("llama3", str(tmp_path), seed=1)
    params_b = nnx.to_pure_dict(nnx.state(load_model(str(tmp_path), "float32"), nnx.Param))
    llm = LLM(path, dtype="float32", max_model_len=96, max_num_seqs=4, block_size=16)
    prompt = random_prompts(1, seed=24, low=40, high=41)[0]
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20))
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests()
    llm.update_weights(params_b)
    while engine.has_unfinished_requests():
        engine.step()
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for tail in ([], [], random_prompts(1, seed=25, low=30, high=31)[0]):
        # The same prompt (no hit, then a hit on what the new weights computed), then a
        # longer one past the blocks the running request filled after the update.
        longer = prompt + tail
        output = llm.generate([{"prompt_token_ids": longer}], greedy)[0]
        assert output.outputs[0].token_ids == hf_greedy(hf_b, longer, 6)
    assert output.num_cached_tokens > 0
