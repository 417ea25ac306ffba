"""Loading: unsupported architectures and tensor types are named errors that list what is
supported; decode runs without holding the GIL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
from reference import Spec, write_model

from kvserve import ModelError, _core


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    write_model(path, Spec(arch="mamba"))
    with pytest.raises(ModelError) as e:
        _core.Model(path)
    msg = str(e.value)
    assert "mamba" in msg
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        assert arch in msg, msg
    assert "\n" not in msg


def test_unsupported_tensor_type_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "iq4.gguf"
    write_model(path, Spec(raw_types={"blk.1.ffn_up.weight": "IQ4_NL"}))
    with pytest.raises(ModelError) as e:
        _core.Model(path)
    msg = str(e.value)
    assert "blk.1.ffn_up.weight" in msg and "IQ4_NL" in msg, msg
    for ty in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"):
        assert ty in msg, msg


def _longest_stall(call: Callable[[], object]) -> tuple[float, float]:
    """Runs ``call`` in another thread while this one wakes up about every millisecond;
    returns (how long the call took, the longest stretch of it in which this thread did not
    get to run). A call that holds the GIL stalls this thread for nearly all of its duration;
    one that releases it, only as long as the OS takes to schedule a thread."""
    stamps: list[float] = []
    window: list[float] = []
    done = threading.Event()

    def work() -> None:
        window.append(time.perf_counter())
        call()
        window.append(time.perf_counter())
        done.set()

    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
        time.sleep(0.001)
    t.join()
    t0, t1 = window
    edges = [t0, *(s for s in stamps if t0 < s < t1), t1]
    return t1 - t0, max(b - a for a, b in pairwise(edges))


def test_decode_releases_the_gil(model_path: Path) -> None:
    """While a decode call runs in another thread, this thread keeps running Python code: no
    stall longer than half the call. The criterion is relative (no rate of wake-ups is
    assumed), and the same measurement on a call known to hold the GIL must stall."""
    core = _core.Model(model_path, threads=1)
    ctx = core.new_context(1024)
    tokens = [(i * 7919) % core.n_vocab for i in range(1024)]

    def decode(n: int) -> None:
        ctx.clear()
        ctx.decode(tokens[:n], list(range(n)), [0] * n, [False] * (n - 1) + [True])

    # One call of about half a second on this machine (prefill time is about linear in n),
    # calibrated after a warm-up call; the host's speed can change between calibration and
    # measurement, so a call that came out too short is measured again with more tokens.
    decode(16)
    t0 = time.perf_counter()
    decode(64)
    n = int(min(1024, max(64, 64 * 0.5 / (time.perf_counter() - t0))))
    took, stall = _longest_stall(partial(decode, n))
    while took <= 0.2 and n < 1024:
        n = min(1024, 2 * n)
        took, stall = _longest_stall(partial(decode, n))
    print(f"decode of {n}: {took:.3f} s, longest stall of the other thread {stall * 1e3:.1f} ms")
    assert took > 0.2, f"a {n}-token decode took {took:.3f} s: too fast to tell"
    assert stall < 0.5 * took, f"stalled {stall:.3f} s of {took:.3f} s: decode holds the GIL?"

    # Control: sorting a list holds the GIL for the whole call.
    data = [((i * 2654435761) % 1000003) / 7.0 for i in range(1_000_000)]
    took, stall = _longest_stall(lambda: sorted(data))
    print(f"sorted(): {took:.3f} s, longest stall {stall * 1e3:.1f} ms")
    assert stall > 0.5 * took, "the measurement cannot see a call that holds the GIL"
