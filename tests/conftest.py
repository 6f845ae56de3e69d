"""Shared fixtures: tiny random-weight engines of each supported architecture, and the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentmem import Engine
from agentmem.models import embedded_model_dir
from device_guard import HostTensorGuard
from helpers import TINY_CONFIGS, tiny_model


TESTS = Path(__file__).parent
# The slow set, besides tests on the embedded model (the ``engine`` fixture below): the fault
# suite, the examples (each a process loading the embedded model), the standard LangChain suites,
# the at-exit process test, and the store contract's 2 GiB round trips.
SLOW_PATHS = ("reliability", "test_examples.py", "adapters/test_langchain_standard.py",
              "adapters/test_langchain_exit.py")
SLOW_NAMES = ("over_2_gib",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow set: ``make test`` leaves it out, ``make test-all`` and CI run it."""
    for item in items:
        where = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if ("engine" in getattr(item, "fixturenames", ()) or where.startswith(SLOW_PATHS)
                or any(name in item.name for name in SLOW_NAMES)):
            item.add_marker(pytest.mark.slow)


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
