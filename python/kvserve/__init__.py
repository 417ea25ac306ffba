"""kvserve: a CPU inference engine for GGUF language models.

Public API::

    from kvserve import Model
    model = Model.load()  # the default model, downloaded and cached on first use
    print(model.generate("The capital of France is", max_tokens=16).text)

The compiled engine (``kvserve._core``) is imported on first use of :class:`Model`,
:func:`generate`, :class:`Engine`, :class:`ModelError` or :class:`KvCacheFull`, so pure-Python parts
(:mod:`kvserve.sampling`, :mod:`kvserve.models`) import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .models import FetchError
from .sampling import TokenLogprob
from .sessions import SessionFileError, SessionInfo

if TYPE_CHECKING:
    from ._model import EngineError, GenerateResult, KvCacheFull, Model, ModelError, generate
    from .engine import Engine


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "0.1.0"


__version__ = _version()

__all__ = [
    "Engine",
    "EngineError",
    "FetchError",
    "GenerateResult",
    "KvCacheFull",
    "Model",
    "ModelError",
    "SessionFileError",
    "SessionInfo",
    "TokenLogprob",
    "__version__",
    "generate",
]

_LAZY = {"EngineError", "GenerateResult", "KvCacheFull", "Model", "ModelError", "generate"}


def __getattr__(name: str) -> Any:
    if name == "Engine":
        value = importlib.import_module(".engine", __name__).Engine
        globals()[name] = value
        return value
    if name in _LAZY:
        value = getattr(importlib.import_module("._model", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY | {"Engine"})
