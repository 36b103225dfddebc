"""Pooling: how an embedding engine pools, and what one embedding request asks for.

Where it sits: `--runner pooling` (`ModelConfig.runner`) turns a decoder checkpoint into an
embedding model. `PoolerConfig.from_checkpoint` reads how the checkpoint pools (its
sentence-transformers files when it has them, vLLM's default of last-token pooling,
normalised, when not); the engine core's runner (jengine/runner/pooler.py) pools each
prompt's final hidden states that way and sends back the raw float32 vector
(`EngineCoreOutput.pooled`); the front end applies the request's `PoolingParams`
(`embedding_of`): matryoshka truncation to `dimensions`, then L2 normalisation. Like
`sampling_params.py` it sits at the top of the package because both sides use it, and it
imports no jax.

What it promises: a `PoolingParams` that reached the engine was checked against the
engine's `PoolerConfig` (`verified`); a checkpoint whose sentence-transformers pipeline
jengine cannot reproduce (max or weighted pooling, Dense layers) is a ValueError naming
the part, never a silently different embedding.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import msgspec
import numpy as np

from jengine.sampling_params import check_truncate_prompt_tokens

# LAST: the last prompt token's hidden state; MEAN: the mean over the prompt; CLS: the
# first token's (vLLM's names).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes jengine runs: `pooling_mode` in its Pooling config
# (v6 on), or one `pooling_mode_<mode>` flag set (earlier versions).
_ST_MODES = {
    "lasttoken": "LAST",
    "mean_tokens": "MEAN",
    "mean": "MEAN",
    "cls_token": "CLS",
    "cls": "CLS",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding engine pools (vLLM's `--pooler-config`).

    pooling_type: LAST, MEAN or CLS over the final (normed) hidden states of the prompt.
    normalize: the default of requests that do not say: L2-normalise the embedding.
    dimensions: what a request's `dimensions` may be: None refuses any (the model was not
        trained for truncated embeddings), () allows 1..hidden_size (a matryoshka model),
        else the listed sizes (the config's `matryoshka_dimensions`).
    hidden_size: the embedding's full size.
    max_seq_length: the most tokens the model embeds (sentence-transformers'; None: no
        limit of its own), which caps max_model_len.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None
    hidden_size: int | None = None
    max_seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}"
            )

    @classmethod
    def from_checkpoint(
        cls, path: str | None, hf_config: dict, override: dict | str | None = None
    ) -> PoolerConfig:
        """The checkpoint folder's pooling (sentence-transformers `modules.json` and its
        Pooling / Normalize modules), its matryoshka sizes (`matryoshka_dimensions`,
        `is_matryoshka` in config.json), then `override` (`pooling_type`, `normalize`:
        `--pooler-config` as JSON or a dict) on top."""
        fields = {}
        if path is not None and os.path.isdir(path):
            fields.update(_sentence_transformers_pooling(path))
        sizes = hf_config.get("matryoshka_dimensions")
        if sizes:
            fields["dimensions"] = tuple(sorted(int(d) for d in sizes))
        elif hf_config.get("is_matryoshka"):
            fields["dimensions"] = ()
        fields["hidden_size"] = hf_config.get("hidden_size")
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from e
        if override:
            unknown = set(override) - {"pooling_type", "normalize"}
            if unknown:
                raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}")
            if "pooling_type" in override:
                fields["pooling_type"] = str(override["pooling_type"]).upper()
            if "normalize" in override:  # "false" once read as True (a non-empty string)
                normalize = override["normalize"]
                if not isinstance(normalize, bool):
                    raise ValueError(
                        f"pooler_config normalize must be true or false, got {normalize!r}"
                    )
                fields["normalize"] = normalize
        return cls(**fields)


def _sentence_transformers_pooling(path: str) -> dict:
    """PoolerConfig fields from a sentence-transformers folder ({} without modules.json)."""
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    with open(modules_path) as f:
        modules = json.load(f)
    fields = {"normalize": False}
    fields.update(_sentence_bert_config(path))
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            fields["normalize"] = True
        elif kind == "Pooling":
            config_path = os.path.join(path, module.get("path", ""), "config.json")
            with open(config_path) as f:
                fields["pooling_type"] = _pooling_type(json.load(f), config_path)
        else:
            raise ValueError(
                f"{modules_path}: the sentence-transformers module {module.get('type')!r} "
                "is not supported (jengine runs Transformer, Pooling and Normalize)"
            )
    return fields


def _sentence_bert_config(path: str) -> dict:
    """The Transformer module's `sentence_bert_config.json`: its max_seq_length (it cuts
    longer inputs: a longer embedding was another vector, no error); do_lower_case, which
    jengine does not do, is refused."""
    config_path = os.path.join(path, "sentence_bert_config.json")
    if not os.path.isfile(config_path):
        return {}
    with open(config_path) as f:
        config = json.load(f)
    if config.get("do_lower_case"):
        raise ValueError(f"{config_path}: do_lower_case (lowercasing every input) is not supported")
    length = config.get("max_seq_length")
    return {} if length is None else {"max_seq_length": int(length)}


def _pooling_type(pooling: dict, config_path: str) -> str:
    """LAST, MEAN or CLS from a sentence-transformers Pooling config, or a ValueError."""
    mode = pooling.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    else:
        prefix = "pooling_mode_"
        modes = [k[len(prefix) :] for k, v in pooling.items() if k.startswith(prefix) and v]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_path}: jengine pools by one of last-token, mean and first-token (cls); "
            f"this Pooling module asks for {modes}"
        )
    if pooling.get("include_prompt", True) is False:
        raise ValueError(
            f"{config_path}: include_prompt=false (pooling without the instruction's tokens) "
            "is not supported"
        )
    return _ST_MODES[modes[0]]


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What one embedding request asks for (vLLM's `PoolingParams`).

    dimensions: keep the first `dimensions` values (matryoshka models only).
    normalize: L2-normalise the embedding (None: the model's default).
    truncate_prompt_tokens: embed only the prompt's last k tokens (-1: the last
        max_model_len), as `SamplingParams.truncate_prompt_tokens`.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def verified(self, config: PoolerConfig) -> PoolingParams:
        """These params with the engine's defaults filled in; a ValueError for a
        `dimensions` the model does not allow."""
        if self.dimensions is not None:
            allowed = config.dimensions
            if allowed is None:
                raise ValueError(
                    "dimensions: this model does not support matryoshka representation "
                    "(its config.json has neither is_matryoshka nor matryoshka_dimensions)"
                )
            largest = config.hidden_size
            if allowed and self.dimensions not in allowed:
                raise ValueError(
                    f"dimensions must be one of {list(allowed)}, got {self.dimensions}"
                )
            if self.dimensions < 1 or (largest is not None and self.dimensions > largest):
                raise ValueError(f"dimensions must be in [1, {largest}], got {self.dimensions}")
        if self.normalize is None:
            return PoolingParams(
                dimensions=self.dimensions,
                normalize=config.normalize,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
            )
        return self


def embedding_of(pooled: bytes, params: PoolingParams) -> list[float]:
    """The embedding a request gets from the runner's raw float32 vector: truncated to
    `params.dimensions`, then L2-normalised if asked (as torch's F.normalize: eps 1e-12)."""
    vector = np.frombuffer(pooled, np.float32)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector.astype(np.float64))), 1e-12)
    return vector.astype(np.float32).tolist()
