"""Shared fixtures: a tiny world (model, tokenizer, LoRA adapters, tasks) built once per test session."""

from __future__ import annotations

import pytest
import torch

from kvprof.tiny import TinyWorld, build_tiny_world


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    return build_tiny_world(tmp_path_factory.mktemp("tiny_world"))
