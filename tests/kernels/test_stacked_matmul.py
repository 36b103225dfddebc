"""The CPU stacked-matmul kernel (`pallas_kernels/stacked_matmul/cpu.cc`) against its XLA
reference and a float64 oracle: one row to the most it takes, odd output counts (row
blocks of 4 plus a tail), the layer's neighbours filled with NaN so a read outside
`w[layer]` shows, derivatives through the reference, operands it must refuse, and the
entry point's choice (kernel for up to MAX_ROWS float32 rows, reference otherwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.stacked_matmul import (
    cpu,
    stacked_matmul,
    stacked_matmul_reference,
    stacked_matmuls,
)

kernel = jax.jit(cpu.stacked_matmul_cpu)
RUN_TIME_REFUSAL = (jax.errors.JaxRuntimeError, ValueError)  # as in test_cpu_kernel_errors


def operands(rows: int, dim: int, outputs: int, layers: int = 3, layer: int = 1, seed: int = 0):
    """x [rows, dim] and w [layers, outputs, dim] whose layers other than `layer` are NaN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim), np.float32)
    w = np.full((layers, outputs, dim), np.nan, np.float32)
    w[layer] = rng.standard_normal((outputs, dim), np.float32)
    return x, w


@pytest.mark.parametrize(
    "rows, dim, outputs",
    [
        (1, 576, 1536),
        (1, 8, 1),
        (1, 72, 5),
        (2, 64, 17),
        (3, 128, 7),
        (5, 72, 33),
        (8, 64, 9),
        (9, 64, 9),
        (16, 256, 100),
        # Items whose rows do not split evenly into the parts read side by side.
        (1, 64, 150),
        (2, 64, 150),
        (12, 64, 150),
        # Past 16 rows: panels of 30 weight rows (32 without AVX-512), tiles of 6 (4) and
        # the 1-5 left over (pallas_kernels/include/panel.h).
        (17, 64, 9),
        (40, 136, 33),
        (64, 512, 100),
        # A last chunk of x narrower than 64 rows with padding, rows past the last 8 that
        # transpose together, and a last block of inputs shorter than 64.
        (100, 200, 45),
        (128, 72, 5),
    ],
)
def test_kernel_matches_reference_and_float64(rows, dim, outputs):
    x, w = operands(rows, dim, outputs)
    ours = np.asarray(kernel(x, w, 1))
    assert np.isfinite(ours).all()  # nothing read from the NaN layers
    np.testing.assert_allclose(ours, x @ w[1].T.astype(np.float64), rtol=1e-5, atol=2e-5 * dim**0.5)
    np.testing.assert_allclose(ours, stacked_matmul_reference(x, w, 1), rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """1-8 rows stream each weight row alone, 9-16 read four side by side: both sum in the
    same order, so a request's logits are the same bits alone or in a batch of up to 16.
    Past 16 rows (panels) a row's bits again do not depend on the rows beside it."""
    x, w = operands(cpu.MAX_ROWS, 136, 40)
    few = np.asarray(kernel(x[:16], w, 1))
    for rows in (1, 2, 5, 8, 9, 13):
        np.testing.assert_array_equal(np.asarray(kernel(x[:rows], w, 1)), few[:rows])
    many = np.asarray(kernel(x, w, 1))
    for rows in (17, 40, 64, 100):
        np.testing.assert_array_equal(np.asarray(kernel(x[:rows], w, 1)), many[:rows])


def test_every_layer_and_a_traced_index():
    x, w = operands(2, 32, 12, layers=4, layer=0)
    w = np.random.default_rng(1).standard_normal(w.shape).astype(np.float32)
    for layer in range(4):
        np.testing.assert_allclose(
            kernel(x, w, jnp.int32(layer)), x @ w[layer].T, rtol=1e-5, atol=1e-5
        )


def test_derivatives_are_the_reference_ones():
    x, w = operands(3, 32, 9)
    w[np.isnan(w)] = 0.0

    def loss(matmul, x, w):
        return jnp.sum(jnp.sin(matmul(x, w, 1)))

    ours = jax.grad(lambda *a: loss(cpu.stacked_matmul_cpu, *a), (0, 1))(x, w)
    theirs = jax.grad(lambda *a: loss(stacked_matmul_reference, *a), (0, 1))(x, w)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype",
    [
        ((cpu.MAX_ROWS + 1, 32), (2, 8, 32), np.float32),
        ((2, 12), (2, 8, 12), np.float32),
        ((2, 32), (2, 8, 32), jnp.bfloat16),
    ],
    ids=["too-many-rows", "dim-not-multiple-of-8", "bfloat16"],
)
def test_operands_it_does_not_take_go_to_the_reference(x_shape, w_shape, dtype):
    x, w = jnp.ones(x_shape, dtype), jnp.ones(w_shape, dtype)
    assert not cpu.supports(x, w)
    with pytest.raises(ValueError, match="stacked-matmul kernel takes float32"):
        cpu.stacked_matmul_cpu(x, w, 0)
    text = jax.jit(lambda x, w: stacked_matmul(x, w, 1)).lower(x, w).as_text()
    assert cpu.TARGET_NAME not in text  # the entry point chose the reference
    np.testing.assert_allclose(stacked_matmul(x, w, 1), stacked_matmul_reference(x, w, 1))


def test_the_entry_point_takes_the_kernel_for_a_few_float32_rows():
    assert cpu.KERNEL.load() is None
    x, w = operands(4, 32, 8)
    text = jax.jit(lambda x, w: stacked_matmul(x, w, 1)).lower(x, w).as_text()
    assert cpu.TARGET_NAME in text
    forced = jax.jit(lambda x, w: stacked_matmul(x, w, 1, impl="reference")).lower(x, w).as_text()
    assert cpu.TARGET_NAME not in forced


def test_a_layer_outside_the_stack_is_refused():
    x, w = operands(1, 16, 4, layers=2)
    for layer in (2, -1):
        with pytest.raises(RUN_TIME_REFUSAL, match=f"layer {layer} is outside w's 2 layers"):
            np.asarray(kernel(x, w, layer))


def test_the_target_refuses_shapes_it_cannot_index_by():
    """Called directly (past `supports`), cpu.cc checks the shapes itself."""
    assert cpu.KERNEL.load() is None
    x, w = operands(2, 16, 4)
    call = jax.ffi.ffi_call(cpu.TARGET_NAME, jax.ShapeDtypeStruct((2, 4), jnp.float32))
    layer = jnp.ones((1,), jnp.int32)
    with pytest.raises(RUN_TIME_REFUSAL, match="with x's D"):
        np.asarray(jax.jit(call)(x[:, :8], layer, w))
    with pytest.raises(RUN_TIME_REFUSAL, match="D must be a multiple of 8"):
        np.asarray(jax.jit(call)(x[:, :12], layer, w[:, :, :12]))
    with pytest.raises(RUN_TIME_REFUSAL, match="one result per weight"):
        np.asarray(jax.jit(call)(x, layer, w, w))
    with pytest.raises(RUN_TIME_REFUSAL, match="out must be"):
        np.asarray(jax.jit(call)(x, layer, w[:, :3]))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16])
def test_an_output_has_the_same_bits_read_beside_others_or_alone(rows):
    """Up to 16 rows of x, an item's weight rows are read several at a time, far apart
    (cpu.cc's `RowsOutputs`, `Outputs`); each output must still be summed as if alone."""
    x, w = operands(rows, 128, 150, layers=1, layer=0)
    together = np.asarray(kernel(x, w, 0))
    alone = [np.asarray(kernel(x, w[:, f : f + 1], 0)) for f in range(150)]
    np.testing.assert_array_equal(together, np.concatenate(alone, axis=1))


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 16, 40])
def test_several_weights_in_one_call_give_each_ones_own_bits(rows):
    """A layer's q, k, v (and gate, up) in one call: the same bits as three calls, whatever
    the rows and however the work items of the weights are shared out."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64), np.float32)
    ws = [rng.standard_normal((2, outputs, 64), np.float32) for outputs in (72, 24, 24, 5)]
    together = jax.jit(cpu.stacked_matmuls_cpu)(x, ws, 1)
    assert len(together) == len(ws)
    for w, out in zip(ws, together, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel(x, w, 1)))
    entry = jax.jit(lambda x, ws: stacked_matmuls(x, ws, 1))
    assert cpu.TARGET_NAME in entry.lower(x, ws).as_text()
    for out, reference in zip(entry(x, ws), stacked_matmuls(x, ws, 1, impl="reference")):
        np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-4)
