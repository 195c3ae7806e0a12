"""Fixtures of the command-line tests."""

from __future__ import annotations

import json

import pytest

from _cli import TINY_LLAMA


@pytest.fixture
def tiny_config(request, tmp_path):
    """A tiny Llama's config.json: the test module's ``TINY_CONFIG`` where it has one, else ``TINY_LLAMA``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(getattr(request.module, "TINY_CONFIG", TINY_LLAMA)))
    return path
