"""The checkpoint's recommended sampling: the temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens) of its `generation_config.json`,
read as vLLM's `--generation-config` reads them.

Where it sits: `LLM.generate` and the OpenAI server (serving_engine.py) use these as the
defaults of a request that leaves a field unset; a request's own value always wins, and
the engine core never sees the file. Plain JSON: the API-server process imports neither
jax nor transformers for it.

- `sampling_defaults(model_config)`: with `generation_config` "vllm", nothing (jengine's
  own defaults: temperature 1, no truncation, no penalty); "auto", the file in the model's
  folder; else the file in that folder. A value equal to transformers' own default is no
  recommendation and is left out, as vLLM leaves it out (an explicit `"top_k": 50` is
  transformers' default, not advice to truncate). A GGUF file or a handed-over module has
  no folder to read: nothing.
- `given_over(defaults, given)`: a request's sampling fields (None: unset) over those
  defaults; a field neither sets is left to SamplingParams' own default. The recommended
  max_tokens is not among them: it is the length of a request that sets none
  (`LLM.generate`'s default SamplingParams; over HTTP, a chat request without
  max_tokens, within the context left).
"""

import json
import logging
import os

logger = logging.getLogger(__name__)

# What generation_config.json may recommend -> transformers' GenerationConfig default.
RECOMMENDABLE = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
# The file's names that SamplingParams calls otherwise.
RENAMED = {"max_new_tokens": "max_tokens"}


def sampling_defaults(model_config) -> dict[str, float | int]:
    """SamplingParams fields -> the values the checkpoint recommends (see module doc)."""
    source = model_config.generation_config
    if source == "vllm":
        return {}
    folder = model_config.model if source == "auto" else source
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"generation_config: {source} holds no generation_config.json")
        return {}
    with open(path) as f:
        recommended = json.load(f)
    defaults = {
        RENAMED.get(name, name): recommended[name]
        for name, default in RECOMMENDABLE.items()
        if recommended.get(name) is not None and recommended[name] != default
    }
    if defaults:
        logger.info(
            "sampling defaults from %s: %s (a request's own values win; "
            "--generation-config vllm ignores the file)",
            path,
            ", ".join(f"{name}={value}" for name, value in defaults.items()),
        )
    return defaults


def given_over(defaults: dict, given: dict) -> dict:
    """SamplingParams fields: those `given` (None: unset) over the recommended `defaults`."""
    sampling = {name: value for name, value in defaults.items() if name != "max_tokens"}
    return {**sampling, **{name: value for name, value in given.items() if value is not None}}
