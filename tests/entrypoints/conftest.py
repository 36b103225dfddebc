"""Fixtures of the serving tests: the tiny model (with a tokenizer) every server uses."""

import pytest

from tests.entrypoints.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))
