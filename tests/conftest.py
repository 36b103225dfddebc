"""Session fixtures shared across test packages: one random-weight Llama checkpoint with
its transformers twin (the fidelity oracle), and `LLM`s over it under each attention setup
of the equality suite."""

import pytest

from tests.engine.engine_helpers import ATTENTION_SETUPS, make_llm
from tests.models.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3_engine")
    hf_model = make_checkpoint("llama3", str(path))
    return str(path), hf_model


@pytest.fixture(scope="session", params=list(ATTENTION_SETUPS))
def attention_setup(request) -> str:
    """Runs a test once per attention setup (see ATTENTION_SETUPS)."""
    return request.param


@pytest.fixture(scope="session")
def llm(checkpoint, attention_setup):
    return make_llm(checkpoint[0], attention_setup)
