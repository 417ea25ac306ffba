"""Shared fixtures.

``model_path``: the GGUF model for tests that run the engine: ``$KVSERVE_TEST_MODEL`` if set,
else the default model from :func:`kvserve.models.pull` (cached after the first download).
A test that asks for it fails, never skips, when no model is available.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> Path:
    env = os.environ.get("KVSERVE_TEST_MODEL")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"KVSERVE_TEST_MODEL={env} is not a file; point it at a GGUF model")
        return path
    from kvserve.models import FetchError, pull

    try:
        return pull(progress=False)
    except FetchError as e:
        pytest.fail(
            f"no test model: KVSERVE_TEST_MODEL is unset and pulling the default model failed "
            f"({e}); set KVSERVE_TEST_MODEL to a GGUF file"
        )
