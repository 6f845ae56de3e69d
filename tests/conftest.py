"""Shared fixtures: tiny random-weight engines of each supported architecture, and the embedded model."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agentmem import Engine
from agentmem.models import embedded_model_dir
from device_guard import HostTensorGuard
from helpers import TINY_CONFIGS, tiny_model


@pytest.fixture(autouse=True)
def tensors_name_their_device():
    """Every test runs under the host-tensor guard (see ``device_guard``)."""
    with HostTensorGuard():
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_engine(request, tokenizer) -> Engine:
    return Engine(tiny_model(request.param), tokenizer)


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine.load("embedded", device="cpu")
