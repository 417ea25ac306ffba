"""Loading: unsupported architectures and tensor types are named errors that list what is
supported; decode runs without holding the GIL."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from reference import Spec, write_model

from kvserve import ModelError, _core


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "gemma3.gguf"
    write_model(path, Spec(arch="gemma3"))
    with pytest.raises(ModelError) as e:
        _core.Model(path)
    msg = str(e.value)
    assert "gemma3" in msg
    for arch in ("llama", "qwen2", "qwen3"):
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


def test_decode_releases_the_gil(model_path: Path) -> None:
    """While a long prefill runs in another thread, this thread keeps running Python code."""
    core = _core.Model(model_path, threads=2)
    ctx = core.new_context(1024)
    n = 512
    tokens = [(i * 7919) % core.n_vocab for i in range(n)]
    done = threading.Event()
    started = threading.Event()

    def work() -> None:
        started.set()
        for _ in range(3):
            ctx.clear()
            ctx.decode(tokens, list(range(n)), [0] * n, [False] * (n - 1) + [True])
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    ticks = 0
    t0 = time.perf_counter()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    t.join()
    # A held GIL would stall this loop for the whole decode (about a second on 2 cores); with the
    # GIL released it wakes up about every millisecond.
    assert elapsed > 0.2, "decode finished too fast to tell"
    print(f"ticks {ticks} in {elapsed:.3f} s")
    assert ticks > elapsed * 1000 * 0.3, (ticks, elapsed)
