#!/usr/bin/env python3
"""Record llama.cpp's logits for the tiny random LFM2 models of tests/lfm2_reference.py.

For every variant in ``lfm2_reference.VARIANTS`` the script writes the GGUF file (same seed:
the same bytes the tests write; the file's SHA-256 is recorded and the tests check it), loads
it in llama.cpp through llama-cpp-python, evaluates the prompt (token ids, so no tokenizer is
involved) in one batch and records the logits of every prompt position, then 8 greedy steps
(argmax of llama.cpp's raw logits, one token per call) and their logits.

Output: tests/fixtures/lfm2_tiny.json (metadata, token ids, SHA-256 of each file) and
tests/fixtures/lfm2_tiny_logits.npz (float32 logits, ``<variant>/prompt`` and
``<variant>/steps``).

How to reproduce (with the llama.cpp build of scripts/build_llama_cpp.sh):

  source <LLAMA_DIR>/env.sh      # LLAMA_CPP_LIB_PATH for the binding
  python scripts/record_lfm2_fixtures.py   # an interpreter with llama_cpp, gguf and numpy
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

import lfm2_reference as lref  # noqa: E402

OUT_JSON = REPO_ROOT / "tests" / "fixtures" / "lfm2_tiny.json"
OUT_NPZ = REPO_ROOT / "tests" / "fixtures" / "lfm2_tiny_logits.npz"
N_STEPS = 8
# Token ids of the tiny vocabulary (bytes and merges), a fixed pseudo-text.
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, lref.ref.N_VOCAB, 40)]


def main() -> None:
    from llama_cpp import Llama, llama_cpp

    records = []
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in lref.VARIANTS.items():
            path = Path(tmp) / f"{name}.gguf"
            lref.write_model(path, spec)
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            llm = Llama(
                model_path=str(path),
                n_ctx=256,
                n_batch=256,
                n_threads=2,
                logits_all=True,
                verbose=False,
                flash_attn=False,
            )
            llm.reset()
            llm.eval(PROMPT)
            prompt_logits = np.array(llm.scores[: len(PROMPT)], dtype=np.float32)
            greedy: list[int] = []
            steps = []
            logits = prompt_logits[-1]
            for _ in range(N_STEPS):
                nxt = int(np.argmax(logits))
                greedy.append(nxt)
                llm.eval([nxt])
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                steps.append(logits)
            arrays[f"{name}/prompt"] = prompt_logits
            arrays[f"{name}/steps"] = np.stack(steps)
            records.append({"name": name, "sha256": sha, "greedy_tokens": greedy})
            print(f"{name:20s} greedy {greedy}")
            del llm
    meta = {
        "what": "llama.cpp logits for tests/lfm2_reference.py VARIANTS (prompt: all positions)",
        "recorded": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "machine": platform.machine(),
        "kv_type": "f16",
        "flash_attn": False,
        "prompt_tokens": PROMPT,
        "variants": records,
    }
    OUT_JSON.write_text(json.dumps(meta, indent=1) + "\n")
    np.savez_compressed(OUT_NPZ, **arrays)
    print(f"wrote {OUT_JSON} and {OUT_NPZ}")


if __name__ == "__main__":
    main()
