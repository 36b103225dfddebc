"""The mixture-of-experts block's ways of computing its experts, side by side: the grouped
matmul over tokens sorted by expert (`jax.lax.ragged_dot`), the gathered experts a decode
step takes (each (token, expert) pair reads its expert's weights), the block as the model
runs it (whichever way `experts_impl` picks for the batch), and the dense per-expert loop
(every expert on every token, masked by the routing), on the same random weights and
tokens.

Where it sits: `models/moe.py` is what it times; the values are checked against the loop
before any timing (max abs difference reported). Shapes: a Mixtral-like layer (8 experts,
top-2) and a many-small-experts layer like Qwen3-MoE's (64 experts, top-4), scaled to fit
this machine, float32, one layer's weights stacked as the model holds them.

    jengine bench moe [--batches 1,64] [--repeats 10]
"""

import argparse
import time

import numpy as np

from .common import count, package_versions, print_header, write_result

SHAPES = {
    # name: (experts, top-k, hidden, expert width)
    "mixtral-like (8 experts, top-2, 1024 x 2816)": (8, 2, 1024, 2816),
    "qwen3-moe-like (64 experts, top-4, 1024 x 512)": (64, 4, 1024, 512),
}


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def measure(shape, batch: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jengine.models.decoder import DecoderConfig
    from jengine.models.moe import (
        dense_moe_mlp,
        experts_impl,
        gathered_experts,
        grouped_experts,
        moe_mlp,
        route,
    )
    from jengine.models.rope_config import RopeConfig

    experts, top_k, hidden, width = shape
    config = DecoderConfig(
        vocab_size=8, hidden_size=hidden, intermediate_size=width, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8, rms_norm_eps=1e-6,
        rope=RopeConfig(hidden // 8), num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, norm_topk_prob=True,
    )  # fmt: skip
    rng = np.random.default_rng(0)

    def array(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32)

    p = {
        "router": array(1, experts, hidden),
        "expert_gate": array(1, experts, width, hidden),
        "expert_up": array(1, experts, width, hidden),
        "expert_down": array(1, experts, hidden, width),
    }
    x = array(batch, hidden)

    # Weights are arguments, not constants the compiler would fold.
    def routed(x, p):
        return route(x, p["router"][0], top_k, True)

    def experts_of(p):
        return p["expert_gate"], p["expert_up"], p["expert_down"]

    ways = {
        "grouped (ragged_dot)": jax.jit(
            lambda x, p: grouped_experts(
                x, *routed(x, p), *(w[0] for w in experts_of(p)), activation="silu"
            )
        ),
        "gathered experts": jax.jit(
            lambda x, p: gathered_experts(x, *routed(x, p), *experts_of(p), 0, activation="silu")
        ),
        f"the block ({experts_impl(batch * top_k, experts)})": jax.jit(
            lambda x, p: moe_mlp(x, p, config, 0)
        ),
        "dense per-expert loop": jax.jit(
            lambda x, p: dense_moe_mlp(x, {k: v[0] for k, v in p.items()}, config)
        ),
    }
    dense = np.asarray(ways["dense per-expert loop"](x, p))
    rows = {}
    for name, fn in ways.items():
        diff = float(np.abs(np.asarray(fn(x, p)) - dense).max())
        ms = _best_ms(lambda fn=fn: fn(x, p).block_until_ready(), repeats)
        rows[name] = dict(ms=round(ms, 3), max_abs_diff_vs_loop=diff)
    loop_ms = rows["dense per-expert loop"]["ms"]
    for row in rows.values():
        row["speedup_vs_loop"] = round(loop_ms / row["ms"], 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jengine bench moe", description=__doc__)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=count, default=10)
    parser.add_argument("--out", default=None, help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.out is None:
        from .common import RESULTS_DIR

        args.out = str(RESULTS_DIR / "moe.json")
    versions = package_versions("jax", "jaxlib")
    print_header("moe", args, versions)
    results = {}
    for shape_name, shape in SHAPES.items():
        for batch in (int(b) for b in args.batches.split(",")):
            rows = measure(shape, batch, args.repeats)
            results[f"{shape_name}, batch {batch}"] = rows
            print(f"\n{shape_name}, batch {batch} tokens")
            for name, row in rows.items():
                print(
                    f"  {name:28s} {row['ms']:9.2f} ms  {row['speedup_vs_loop']:5.2f}x the loop"
                    f"  (max |diff| vs loop {row['max_abs_diff_vs_loop']:.1e})"
                )
    write_result("moe", args, versions, dict(results=results))


if __name__ == "__main__":
    main()
