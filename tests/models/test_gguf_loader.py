"""GGUF checkpoints: a Llama written from an HF folder loads to exactly the folder's
weights (q/k permutation undone, tied and untied heads), quantized files to the
reference dequantization, the engine runs them, and broken files fail clearly."""

import os
import pathlib
import shutil

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

from jengine import LLM, SamplingParams
from jengine.models import load_model
from jengine.models.checkpoint import gguf_file, read_hf_config
from jengine.models.gguf_loader import unpermute_rotary
from jengine.models.gguf_reader import read_gguf
from jengine.models.llama import LINEAR_WEIGHTS
from jengine.models.quantized_linear import param_value
from jengine.pallas_kernels.quantized_matmul import dequantize
from tests.models.checkpoints import hf_logits, make_checkpoint
from tests.models.gguf_files import permute_rotary, write_llama_gguf
from tests.models.paged_batch import PagedSequences

GQA = dict(num_key_value_heads=2)  # q and k permuted with different head counts


def _leaves(model) -> dict[str, np.ndarray]:
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(state)}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_folder(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    make_checkpoint("llama2", path, config_overrides={**GQA, "tie_word_embeddings": request.param})
    return path


def test_permutation_round_trip():
    weight = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rotary(permute_rotary(weight, 2), 2), weight)
    assert not np.array_equal(permute_rotary(weight, 2), weight)


def test_f32_gguf_loads_the_hf_weights_exactly(hf_folder, tmp_path):
    path = write_llama_gguf(hf_folder, str(tmp_path / "model.gguf"))
    hf_config, gguf_config = read_hf_config(hf_folder), read_hf_config(path)
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert gguf_config[key] == hf_config[key]
    assert gguf_config["tie_word_embeddings"] == hf_config["tie_word_embeddings"]
    ours, theirs = _leaves(load_model(path, "float32")), _leaves(load_model(hf_folder, "float32"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


# What llama.cpp's GGUF of each family holds differently from a Llama's: q/k not
# permuted, Qwen2's biases, Qwen3's and Gemma 3's q/k norms, Gemma's norms stored plus one
# and its window, soft-caps and linear rope scaling in the metadata. Gemma's
# query_pre_attn_scalar is not in a GGUF: the head size loads, as in every Gemma but the
# 27Bs (test_gemma_27b_scales_queries_by_hidden_over_heads).
GGUF_FAMILIES = {
    "llama3": {},  # its rope scaling as llama.cpp writes it: rope_freqs.weight
    "qwen2": {},
    "qwen3": {},
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=32),
}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_other_architectures_load_as_their_folders(tmp_path, family):
    folder = str(tmp_path / family)
    hf_model = make_checkpoint(family, folder, config_overrides=GGUF_FAMILIES[family])
    path = write_llama_gguf(folder, str(tmp_path / "model.gguf"))
    ours, theirs = _leaves(load_model(path, "float32")), _leaves(load_model(folder, "float32"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        # Gemma's norms went through the converter's + 1: one rounding.
        np.testing.assert_allclose(ours[name], theirs[name], rtol=2e-7, atol=0, err_msg=name)
    model = load_model(path, "float32")
    seq = list(range(3, 26))
    got = PagedSequences(model, [seq], block_size=4).step({0: len(seq)}, q_block_size=4)[0]
    np.testing.assert_allclose(got, hf_logits(hf_model, seq).numpy(), atol=1e-4, rtol=0)
    kept = load_model(write_llama_gguf(folder, str(tmp_path / "q8.gguf"), "Q8_0"), "float32")
    assert {name for name, _ in kept.config.quantization} >= {"q_proj", "down_proj"}


@pytest.mark.parametrize(
    ("arch", "layers", "hidden", "heads", "head_dim", "scalar"),
    [
        ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B: the head size
        ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads
        ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
        ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ],
)
def test_gemma_27b_scales_queries_by_hidden_over_heads(
    tmp_path, arch, layers, hidden, heads, head_dim, scalar
):
    """A GGUF does not hold query_pre_attn_scalar: what loads is each release's own value
    (transformers' GGUF loader takes 256 for all, which a 27B's attention differs from)."""
    path = str(tmp_path / "metadata.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_key_length(head_dim)
    writer.add_vocab_size(256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_hf_config(path)["query_pre_attn_scalar"] == scalar


@pytest.mark.parametrize("quantization", [None, "none"])
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_loads_the_reference_dequantization(
    hf_folder, tmp_path, tensor_type, quantization
):
    """Kept quantized (the default) or dequantized at load, the weights are ggml's
    reference dequantization of the file, bit for bit."""
    path = write_llama_gguf(hf_folder, str(tmp_path / "model.gguf"), tensor_type)
    model = load_model(path, "float32", quantization)
    kept = dict(model.config.quantization)
    if quantization == "none":
        assert not kept
    else:
        assert set(LINEAR_WEIGHTS) <= set(kept), kept
    reader = gguf.GGUFReader(path)
    ref = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    heads = model.config.num_attention_heads

    def weight(param) -> np.ndarray:
        value = param_value(param)
        return np.asarray(value if isinstance(param, nnx.Param) else dequantize(value))

    np.testing.assert_array_equal(
        weight(model.layers.q_proj)[1], unpermute_rotary(ref["blk.1.attn_q.weight"], heads)
    )
    np.testing.assert_array_equal(weight(model.layers.down_proj)[0], ref["blk.0.ffn_down.weight"])
    np.testing.assert_array_equal(weight(model.embed_tokens), ref["token_embd.weight"])


def test_engine_on_gguf_generates_as_on_the_folder(hf_folder, tmp_path):
    folder = tmp_path / "gguf-folder"
    folder.mkdir()
    write_llama_gguf(hf_folder, str(folder / "model.gguf"))
    assert gguf_file(str(folder)) == str(folder / "model.gguf")  # a folder holding one
    kwargs = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [[5, 17, 200, 3, 99], [8, 250, 1]]
    ours = LLM(str(folder), **kwargs).generate(prompts, params, use_tqdm=False)
    theirs = LLM(hf_folder, **kwargs).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


def test_reader_agrees_with_the_gguf_package(hf_folder, tmp_path):
    path = write_llama_gguf(hf_folder, str(tmp_path / "model.gguf"), "Q4_1")
    ours, reader = read_gguf(path), gguf.GGUFReader(path)
    assert ours.tensors.keys() == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        data = ours.tensor_data(tensor.name)
        assert data.shape == tuple(tensor.data.shape)
        assert np.array_equal(data.view(np.uint8), np.asarray(tensor.data).view(np.uint8))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key


def test_broken_ggufs_fail_clearly(hf_folder, tmp_path):
    extra = write_llama_gguf(
        hf_folder,
        str(tmp_path / "extra.gguf"),
        extra_tensors={"blk.0.attn_q.bias": np.zeros(4, np.float32)},
    )
    with pytest.raises(ValueError, match=r"no place for \['blk.0.attn_q.bias'\]"):
        load_model(extra, "float32")
    other = write_llama_gguf(hf_folder, str(tmp_path / "other.gguf"), arch="gpt2")
    with pytest.raises(
        ValueError, match="architecture .gpt2.*jengine runs gemma2, gemma3, llama, qwen2, qwen3"
    ):
        load_model(other, "float32")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_hf_config(str(not_gguf))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(pathlib.Path(extra).read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_hf_config(str(truncated))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(extra, two / name)
    with pytest.raises(ValueError, match="several .gguf files"):
        read_hf_config(str(two))
    assert os.path.isfile(extra)
