"""Session fixtures shared across test packages: one random-weight Llama checkpoint with
its transformers twin (the fidelity oracle), and an `LLM` over it."""

import pytest

from tests.engine.engine_helpers import ENGINE_KWARGS
from tests.models.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3_engine")
    hf_model = make_checkpoint("llama3", str(path))
    return str(path), hf_model


@pytest.fixture(scope="session")
def llm(checkpoint):
    from jengine import LLM

    return LLM(checkpoint[0], **ENGINE_KWARGS)
