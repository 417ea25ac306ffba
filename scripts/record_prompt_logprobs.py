#!/usr/bin/env python3
"""Record llama.cpp's prompt log-probabilities for kvserve's tests (echo / prompt_logprobs).

What it records into tests/fixtures/llama_smollm2_prompt_logprobs.json (the SmolLM2-135M-Instruct
Q4_1 GGUF, the default model): for a few prompts (short, with chat markup, Unicode, code, and a
~300-token text), the prompt's token ids (add_special=True, parse_special=True, as the
engine tokenizes a text prompt), then for every prompt token after the first its
log-probability given the tokens before it and the top-5 token ids and log-probabilities at
that position: llama.cpp's logits of every prompt position (``logits_all``, the whole prompt in
one call) turned into float64 ``log_softmax`` here, as scripts/record_llama_fixtures.py does
for generated tokens.

``--calibrate`` also runs llama.cpp with the other flash-attention setting over the same prompts
and stores how far llama.cpp moves from itself (``calibration``: the largest and mean
|difference| of the token log-probabilities, and of the top-5 ones), from which
tests/test_prompt_logprobs.py derives its tolerance, as tests/test_golden.py does from
tests/fixtures/llama_smollm2.json's calibration.

How to reproduce (exactly what produced the fixture):

  scripts/build_llama_cpp.sh [LLAMA_DIR]     # llama.cpp + the llama-cpp-python binding
  source <LLAMA_DIR>/env.sh                  # exports LLAMA_CPP_LIB_PATH
  python scripts/record_prompt_logprobs.py --model <SmolLM2-135M-Instruct.Q4_1.gguf> \\
      --flash-attn off --calibrate

--model defaults to $KVSERVE_TEST_MODEL.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_llama_fixtures import (  # noqa: E402
    LONG_PROMPT,
    N_THREADS,
    PROMPTS,
    REPO_ROOT,
    llama_src_info,
    log_softmax,
    sha256_file,
    top_k,
)

OUT_JSON = REPO_ROOT / "tests" / "fixtures" / "llama_smollm2_prompt_logprobs.json"
N_CTX = 1024
N_BATCH = 512
TOP_N = 5

_BY_NAME = dict(PROMPTS)
PROMPT_SET: list[tuple[str, str]] = [
    ("capital_france", _BY_NAME["capital_france"] + " Paris."),
    ("chat_system_haiku", _BY_NAME["chat_system_haiku"]),
    ("unicode_mixed", _BY_NAME["unicode_mixed"]),
    ("python_import", _BY_NAME["python_import"]),
    ("long_lighthouse", LONG_PROMPT),
]


def record(llm: Any) -> list[dict[str, Any]]:
    """Every prompt evaluated in one call; each position's entry from the row before it."""
    records = []
    for name, text in PROMPT_SET:
        toks = [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)]
        assert len(toks) < N_BATCH, "prompt must fit one batch"
        llm.reset()
        llm.eval(toks)
        token_logprobs: list[float | None] = [None]
        tops: list[dict[str, list[Any]] | None] = [None]
        for i in range(1, len(toks)):
            lp = log_softmax(np.array(llm.scores[i - 1], dtype=np.float32))
            token_logprobs.append(round(float(lp[toks[i]]), 6))
            ids, lps = top_k(lp, TOP_N)
            tops.append({"ids": ids, "logprobs": lps})
        records.append(
            {
                "name": name,
                "text": text,
                "prompt_tokens": toks,
                "token_logprobs": token_logprobs,
                "top": tops,
            }
        )
        print(f"{name:20s} n_prompt={len(toks):4d} sum={sum(token_logprobs[1:]):.3f}")
    return records


def compare(ref: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """How far ``other`` is from ``ref`` over every prompt position: the token
    log-probabilities, and ``ref``'s top-5 tokens' where ``other`` has them in its top 5."""
    tok, top = [], []
    for a, b in zip(ref, other, strict=True):
        assert a["prompt_tokens"] == b["prompt_tokens"]
        for i in range(1, len(a["prompt_tokens"])):
            tok.append(abs(a["token_logprobs"][i] - b["token_logprobs"][i]))
            theirs = dict(zip(b["top"][i]["ids"], b["top"][i]["logprobs"], strict=True))
            ds = [
                abs(lp - theirs[t])
                for t, lp in zip(a["top"][i]["ids"], a["top"][i]["logprobs"], strict=True)
                if t in theirs
            ]
            top.append(max(ds))
    return {
        "token_logprob_max": round(float(np.max(tok)), 6),
        "token_logprob_mean": round(float(np.mean(tok)), 6),
        "top5_logprob_max": round(float(np.max(top)), 6),
        "top5_logprob_mean": round(float(np.mean(top)), 6),
        "n_positions": len(tok),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.environ.get("KVSERVE_TEST_MODEL"))
    lib = os.environ.get("LLAMA_CPP_LIB_PATH")
    ap.add_argument(
        "--llama-src", default=str(Path(lib).parent.parent) if lib else None, help="llama.cpp tree"
    )
    ap.add_argument("--out", default=str(OUT_JSON))
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off")
    ap.add_argument("--calibrate", action="store_true")
    args = ap.parse_args()
    if not args.model:
        ap.error("--model is required (or set KVSERVE_TEST_MODEL)")
    if not lib:
        ap.error("set LLAMA_CPP_LIB_PATH to the llama.cpp build/bin directory holding libllama")

    import llama_cpp
    from llama_cpp import Llama

    def load(flash_attn: bool) -> Llama:
        return Llama(
            args.model,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_ubatch=N_BATCH,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            logits_all=True,
            flash_attn=flash_attn,
            verbose=False,
            seed=0,
        )

    llm = load(args.flash_attn == "on")
    n_vocab = llm.n_vocab()
    records = record(llm)
    del llm
    calibration = None
    if args.calibrate:
        other = "off" if args.flash_attn == "on" else "on"
        print(f"calibration: flash attention {other}")
        calibration = {"flash_attn": other, **compare(records, record(load(other == "on")))}
        print(f"calibration: {json.dumps(calibration)}")

    meta: dict[str, Any] = {
        "generator": "scripts/record_prompt_logprobs.py",
        "command": (
            "LLAMA_CPP_LIB_PATH=<llama.cpp>/build/bin python scripts/record_prompt_logprobs.py "
            f"--model <{os.path.basename(args.model)}> --flash-attn {args.flash_attn}"
            + (" --calibrate" if args.calibrate else "")
        ),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp": llama_src_info(args.llama_src) if args.llama_src else {"commit": "unknown"},
        "machine": platform.machine(),
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "n_vocab": n_vocab,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "n_threads": N_THREADS,
        "top_n": TOP_N,
        "flash_attn": args.flash_attn,
        "tokenize": {"add_special": True, "parse_special": True},
        "logprobs": (
            "float64 log_softmax of the raw logits of position i - 1 (logits_all), for prompt"
            " token i >= 1; token 0 has none (null)"
        ),
        "decode_loop": "the whole prompt in one call",
    }
    if calibration is not None:
        meta["calibration"] = calibration
    # The metadata indented, each prompt's record on one line (the file stays small).
    head = json.dumps({"meta": meta}, ensure_ascii=False, indent=1)[:-2]
    lines = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in records]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(head + ',\n "prompts": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
