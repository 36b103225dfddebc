"""fp8 by GPTQ's rounding (models/gptq.py) and its calibration inputs (models/calibration.py):
the format rounding to nearest has, rounding that lowers the output error the Gram matrix
measures, and Gram matrices that are the model's own inputs to each linear weight."""

import jax.numpy as jnp
import numpy as np
import torch

from jengine.models import load_model
from jengine.models.calibration import input_grams, own_samples
from jengine.models.gptq import gptq_fp8
from jengine.models.quantize import FP8, quantize
from tests.models.checkpoints import VOCAB, make_checkpoint


def _dequantized(arrays):
    return arrays["values"].astype(np.float32) * arrays["scales"]


def _output_error(weight, dequantized, inputs):
    """sum over tokens of |x (W - Q)^T|^2 per layer: what GPTQ lowers."""
    return np.square(np.einsum("ltd,lfd->ltf", inputs, weight - dequantized)).sum(axis=(1, 2))


def test_gptq_lowers_the_output_error_in_the_same_format():
    rng = np.random.default_rng(0)
    layers, rows, columns, tokens = 3, 24, 80, 400  # 80: not a whole number of blocks
    weight = rng.normal(size=(layers, rows, columns)).astype(np.float32)
    # Inputs whose features vary together (and one never seen), as a layer's do.
    mixing = rng.normal(size=(layers, columns, columns)).astype(np.float32)
    inputs = np.einsum("ltd,lde->lte", rng.normal(size=(layers, tokens, columns)), mixing)
    inputs[..., 7] = 0.0
    inputs = inputs.astype(np.float32)
    gram = np.einsum("ltd,lte->lde", inputs, inputs)
    nearest = quantize(weight, FP8)
    rounded = gptq_fp8(weight, gram)
    # The same format, scales and kernel: only which way values round differs.
    assert rounded["values"].dtype == jnp.float8_e4m3fn
    assert rounded["values"].shape == weight.shape
    np.testing.assert_array_equal(rounded["scales"], nearest["scales"])
    # Each value is one of its two nearest e4m3 neighbours or further only where GPTQ's
    # updates moved it: most stay within one step of nearest rounding.
    differs = rounded["values"].astype(np.float32) != nearest["values"].astype(np.float32)
    assert 0.05 < differs.mean() < 0.6, differs.mean()
    ours = _output_error(weight, _dequantized(rounded), inputs)
    theirs = _output_error(weight, _dequantized(nearest), inputs)
    assert np.all(ours < 0.7 * theirs), (ours, theirs)


def test_gptq_with_uncorrelated_inputs_rounds_to_nearest():
    """A diagonal Gram matrix spreads no error (U is diagonal): rounding to nearest."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(2, 16, 64)).astype(np.float32)
    gram = np.broadcast_to(np.diag(rng.uniform(1, 5, size=64)), (2, 64, 64)).astype(np.float32)
    np.testing.assert_array_equal(
        gptq_fp8(weight, gram)["values"].astype(np.float32),
        quantize(weight, FP8)["values"].astype(np.float32),
    )


def test_calibration_samples_and_grams_are_the_models_own(tmp_path):
    make_checkpoint("qwen2", str(tmp_path))  # q/k/v biases: the grams are of the inputs
    model = load_model(str(tmp_path), dtype="float32")
    tokens = np.asarray(own_samples(model, 1, 2, 32))
    assert tokens.shape == (2, 32) and (tokens[:, 0] == 1).all()
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
    assert len({tuple(t) for t in tokens}) == 2  # sampled, not greedy: the two differ
    np.testing.assert_array_equal(tokens, np.asarray(own_samples(model, 1, 2, 32)))
    grams = input_grams(model, jnp.asarray(tokens))
    c = model.config
    assert set(grams) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert grams["down_proj"].shape == (
        c.num_hidden_layers,
        c.intermediate_size,
        c.intermediate_size,
    )
    # Layer 0's attention input is the normed embedding of the tokens, as transformers has it.
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    inputs = []
    hook = hf.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda module, args: inputs.append(args[0])
    )
    with torch.no_grad():
        hf(torch.tensor(tokens))
    hook.remove()
    x = inputs[0].reshape(-1, c.hidden_size).double().numpy()
    np.testing.assert_allclose(grams["q_proj"][0], x.T @ x, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(grams["q_proj"], grams["v_proj"])
