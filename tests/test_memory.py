"""Memory use and kernel-level consistency of the engine on the test model, each measured in a
fresh subprocess (so that RSS and the once-detected SIMD level belong to that run alone).

- Weights are memory-mapped, not copied: RSS right after loading stays within the file size plus
  64 MiB, and the peak RSS after a 16-token decode within the file size plus 128 MiB.
- ``KVSERVE_SIMD=<level>`` forces a kernel family (capped at what the CPU has); every level gives
  the same logits as the default one up to float summation order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

MiB = 1 << 20
LEVELS = ["scalar", "avx2", "avx512", "avx512vnni"]  # lowest first
PROMPT = "The capital of France is Paris, and the capital of Italy is"

MEMORY_SCRIPT = r"""
import json, sys

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                value, unit = rest.split()
                assert unit == "kB", line
                out[key] = int(value) * 1024
    return out

import kvserve._core as core

before = status()
model = core.Model(sys.argv[1])
loaded = status()
ctx = model.new_context(256)
toks = (model.tokenize("The quick brown fox jumps over the lazy dog. " * 4))[:16]
assert len(toks) == 16, toks
out = ctx.decode(toks, list(range(16)), [0] * 16, [False] * 15 + [True])
assert out.n_rows == 1
decoded = status()
print(json.dumps({"before": before, "loaded": loaded, "decoded": decoded}))
"""

LOGITS_SCRIPT = r"""
import json, sys
import numpy as np
import kvserve._core as core

model = core.Model(sys.argv[1])
toks = model.tokenize(sys.argv[2])
ctx = model.new_context(128)
n = len(toks)
out = ctx.decode(toks, list(range(n)), [0] * n, [True] * n)
logits = np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)
np.save(sys.argv[3], logits)
print(json.dumps({"level": core.simd_level(), "n": n}))
"""


def _run(script: str, args: list[str], simd: str | None) -> dict:
    env = dict(os.environ)
    env.pop("KVSERVE_SIMD", None)
    if simd is not None:
        env["KVSERVE_SIMD"] = simd
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rss_stays_near_file_size(model_path: Path):
    size = model_path.stat().st_size
    r = _run(MEMORY_SCRIPT, [str(model_path)], None)
    loaded, peak = r["loaded"]["VmRSS"], r["decoded"]["VmHWM"]
    assert loaded <= size + 64 * MiB, (
        f"RSS after load {loaded / MiB:.1f} MiB > file {size / MiB:.1f} MiB + 64 MiB: "
        "weights copied instead of mapped?"
    )
    assert peak < size + 128 * MiB, (
        f"peak RSS after a 16-token decode {peak / MiB:.1f} MiB "
        f"> file {size / MiB:.1f} MiB + 128 MiB"
    )


TINY_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import reference as ref
import kvserve._core as core

def run(spec, path):
    w = ref.write_model(path, spec)
    model = core.Model(path)
    toks = list(range(0, ref.N_VOCAB, 7))
    n = len(toks)
    out = model.new_context(64).decode(toks, list(range(n)), [0] * n, [True] * n)
    got = np.frombuffer(out, dtype=np.float32).reshape(n, -1).astype(np.float64)
    if spec.branch_scale == 0.0:
        want = ref.matmul_only_logits(w, spec, toks)
    else:
        want = ref.forward(w, spec, toks, kv_f16=True)
    return float(np.abs(got - want).max() / np.abs(want).max())

res = {"level": core.simd_level()}
d = sys.argv[2]
for wt in ["F32", "F16"]:
    res[wt] = run(ref.Spec(wtype=wt, seed=21), f"{d}/{wt}.gguf")
for wt in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]:
    spec = ref.Spec(wtype=wt, tied=False, branch_scale=0.0, seed=22)
    res[wt] = run(spec, f"{d}/{wt}.gguf")
print(json.dumps(res))
"""


@pytest.mark.parametrize("forced", LEVELS)
def test_forced_simd_level_tiny_models_exact_up_to_summation_order(tmp_path, forced):
    """Under each level: a float-weight model agrees with the float64 reference (f16 KV) and a
    one-matmul quantized model with its 8-bit activation emulation, to float32 rounding."""
    tests_dir = str(Path(__file__).parent)
    r = _run(TINY_SCRIPT, [tests_dir, str(tmp_path)], forced)
    level = r.pop("level")
    assert LEVELS.index(level) <= LEVELS.index(forced), (forced, level)
    bad = {k: v for k, v in r.items() if not v < 2e-4}
    assert not bad, f"KVSERVE_SIMD={forced} ({level}): relative max diffs too large: {bad}"


@pytest.fixture(scope="module")
def default_logits(model_path: Path, tmp_path_factory) -> tuple[str, np.ndarray]:
    out = tmp_path_factory.mktemp("simd") / "default.npy"
    r = _run(LOGITS_SCRIPT, [str(model_path), PROMPT, str(out)], None)
    assert r["level"] in LEVELS, r
    return r["level"], np.load(out).astype(np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("forced", LEVELS)
def test_forced_simd_level_matches_default_on_model(
    model_path: Path, tmp_path, default_logits, forced
):
    """On the real model the levels differ by more than summation order: a last-bit difference
    flips a rounding in the 8-bit activation quantization, and 30 layers amplify it. Measured
    between levels on this model: max |diff| / max |logit| up to 0.05, top-5 logprobs up to
    0.44 nats (mean 0.1). The bounds are those tests/test_golden.py calibrated on llama.cpp
    against itself (0.62 nats max there), and 0.08 of the logit scale; a real kernel bug
    breaks the tiny-model test above by orders of magnitude."""
    best, want = default_logits
    out = tmp_path / f"{forced}.npy"
    r = _run(LOGITS_SCRIPT, [str(model_path), PROMPT, str(out)], forced)
    # A forced level is capped at what the CPU supports.
    expected = LEVELS[min(LEVELS.index(forced), LEVELS.index(best))]
    assert r["level"] == expected, f"KVSERVE_SIMD={forced} on a {best} CPU reports {r['level']}"
    got = np.load(out).astype(np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel < 0.08, f"{r['level']} vs {best}: max |diff| / max |logit| = {rel:.3g}"
    a, b = _log_softmax(want), _log_softmax(got)
    top = np.argsort(-a, axis=1)[:, :5]
    dlp = np.abs(np.take_along_axis(a, top, 1) - np.take_along_axis(b, top, 1))
    assert dlp.max() < 1.0 and dlp.mean() < 0.25, (
        f"{r['level']} vs {best}: top-5 logprob diff max {dlp.max():.3f}, mean {dlp.mean():.3f}"
    )
    for i in range(want.shape[0]):
        assert np.corrcoef(want[i], got[i])[0, 1] > 0.99, f"row {i}: logits decorrelated"
