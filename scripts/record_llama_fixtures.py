#!/usr/bin/env python3
"""Record golden reference outputs from llama.cpp for kvserve's tests.

What it records (``--set smollm2``, the default: the SmolLM2-135M-Instruct Q4_1 GGUF, into
tests/fixtures/llama_smollm2*; ``--set gemma3``: the Gemma 3 270M Q4_K_M GGUF, into
tests/fixtures/llama_gemma3*, with prompts of up to ~1,800 tokens so that Gemma's 512-token
sliding window is exceeded and answers depend on the global layers):
  * prompt token ids (add_special=True, i.e. the model's own add_bos rule, parse_special=True),
  * a 16-token greedy continuation computed by argmax over llama.cpp's *raw* logits
    (no sampler chain at all: no temperature, no repeat penalty, no top-k/p),
  * at every generated position, the top-10 token ids and their log-probabilities
    (log_softmax of the raw logits, computed here in float64),
  * the full-vocabulary logits of the last prompt position for a few prompts, saved as float16
    in a compressed .npz next to the JSON.

The decode loop mirrors the one in tests/test_golden.py: the whole prompt is evaluated in one
call (n_batch=512 > longest prompt), then one token per call.

Flash attention: ``--flash-attn off|on`` chooses llama.cpp's attention kernel for the recorded
data (the fixtures use ``off``); the setting is stored in the metadata (``flash_attn``).
``--calibrate`` also runs the other setting over the same prompts and stores how far llama.cpp
moves from itself when only that kernel changes (``calibration``: identical greedy prefix
lengths, and the top-5 logprob differences at the positions both runs reach with the same
context, computed as tests/test_golden.py computes ours). tests/test_golden.py derives its
tolerances from that measurement.

How to reproduce (exactly what produced tests/fixtures/llama_smollm2.json):

  # 1. build llama.cpp (the tree vendored in the llama-cpp-python 0.3.36 sdist) as shared
  #    libraries, GGML_NATIVE=OFF with every ISA of this CPU but AMX, and install the Python
  #    binding without building llama.cpp again (CMAKE_ARGS="-DLLAMA_BUILD=OFF
  #    -DLLAVA_BUILD=OFF" pip install --no-deps . in the sdist, plus its runtime deps):
  scripts/build_llama_cpp.sh [LLAMA_DIR]     # default LLAMA_DIR: llama-build/ in the repo
  source <LLAMA_DIR>/env.sh                  # exports LLAMA_CPP_LIB_PATH (and LLAMA_CPP_BIN_DIR)
  # 2. run this script; the binding loads the cmake-built libllama.so from LLAMA_CPP_LIB_PATH:
  python scripts/record_llama_fixtures.py --model <SmolLM2-135M-Instruct.Q4_1.gguf> \
      --flash-attn off --calibrate
  python scripts/record_llama_fixtures.py --set gemma3 --model <gemma-3-270m-q4_k_m.gguf> \
      --flash-attn off --calibrate

--model defaults to $KVSERVE_TEST_MODEL. --llama-src (default: two levels above
$LLAMA_CPP_LIB_PATH) lets the script read the llama.cpp commit (git) and the build flags
(build/CMakeCache.txt) into the fixture metadata.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_JSON = REPO_ROOT / "tests" / "fixtures" / "llama_smollm2.json"
OUT_LOGITS = REPO_ROOT / "tests" / "fixtures" / "llama_smollm2_logits.npz"

N_GEN = 16
TOP_K = 10
N_CTX = 2048
N_BATCH = 512
N_THREADS = 2

LONG_PROMPT = (
    "The history of the lighthouse is closely tied to the history of sea travel. Long before "
    "electric lamps, coastal communities lit fires on hills and cliffs to warn sailors of rocks "
    "and shallow water. The ancient Pharos of Alexandria, built in the third century BC, was "
    "one of the tallest structures of its time and served as a model for later towers across "
    "the Mediterranean. During the Middle Ages many harbours relied on monks or local guilds "
    "to keep a flame burning through the night. In the eighteenth and nineteenth centuries, "
    "engineers began to build towers on exposed reefs, where waves could break over the "
    "entire structure during storms. Building such a tower required interlocking blocks of "
    "granite, careful study of the tides, and crews who could only work for a few hours each "
    "day when the sea was calm. The invention of the Fresnel lens in 1822 changed everything: "
    "a set of glass prisms arranged in rings could gather the light of a single lamp and send "
    "it as a narrow beam visible for more than twenty miles. Each lighthouse was given its own "
    "pattern of flashes, so that a navigator could identify it at night by counting the "
    "seconds between them. Keepers lived in small rooms at the base of the tower, trimming "
    "wicks, polishing brass, and writing the weather into a log book every few hours. Today "
    "most lighthouses are automated, and satellite navigation has made them less important, "
    "but many are still maintained because a simple light on the horizon remains one of the "
    "most reliable signals a sailor can have. In summary, the main purpose of a lighthouse is"
)

PROMPTS: list[tuple[str, str]] = [
    ("capital_france", "The capital of France is"),
    ("fibonacci", "def fibonacci(n):"),
    ("shopping_list", "Shopping list:\n1. Milk\n2. Eggs\n3."),
    ("chat_2plus2", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    (
        "chat_system_haiku",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("long_lighthouse", LONG_PROMPT),
    ("unicode_mixed", "Café, naïve, façade — 日本語のテキスト and emoji 🚀🌍 mean"),
    ("numbers_count", "1, 2, 3, 4, 5, 6,"),
    ("numbers_arith", "12 + 30 = 42, 100 - 58 ="),
    ("year_fact", "In 1969, the first humans to walk on the Moon were"),
    ("once_upon", "Once upon a time, in a small village by the river,"),
    ("python_import", "import numpy as np\n\nx = np.array([1, 2, 3])\nprint("),
    ("html_snippet", "<html>\n<head>\n<title>"),
    ("json_snippet", '{"name": "Alice", "age": 30, "city": "'),
    ("question_sky", "Q: Why is the sky blue?\nA:"),
    ("whitespace", "   leading spaces\tand\ttabs\n\n\nand newlines"),
    ("single_word", "Hello"),
    ("recipe", "To make a simple pancake batter, you need flour, milk,"),
    ("german", "Der schnelle braune Fuchs springt über den"),
    ("special_mid_text", "Text before <|endoftext|> text after"),
]

# prompts whose full-vocab last-position logits are stored
FULL_LOGIT_PROMPTS = ["capital_france", "chat_2plus2", "long_lighthouse"]


def _keeper_records() -> str:
    """A ~1,800-token document of 85 records and a question about record 3, far outside a
    512-token window from the question (deterministic, no randomness)."""
    first = ["Ada", "Bram", "Cora", "Dov", "Elin", "Finn", "Greta", "Hugo", "Iris", "Jonas", "Kaia"]
    last = [
        "Park",
        "Moreau",
        "Silva",
        "Okafor",
        "Lind",
        "Novak",
        "Reyes",
        "Tanaka",
        "Berg",
        "Costa",
    ]
    places = ["Fenwick", "Harlow", "Kestrel", "Marrow", "Penhallow", "Quill", "Rookhaven", "Saltby"]
    lines = []
    for i in range(85):
        who = f"{first[(i * 7) % len(first)]} {last[(i * 3) % len(last)]}"
        where = f"{places[i % len(places)]} Point {i + 1}"
        lines.append(f"Record {i + 1}: the lighthouse at {where} is kept by {who}.")
    return (
        "Below is the register of lighthouse keepers.\n"
        + "\n".join(lines)
        + "\nQuestion: who keeps the lighthouse at Kestrel Point 3?\nAnswer: It is kept by"
    )


GEMMA_PROMPTS: list[tuple[str, str]] = [
    ("capital_france", "The capital of France is"),
    ("fibonacci", "def fibonacci(n):"),
    (
        "chat_2plus2",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    ),
    (
        "chat_haiku",
        "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    ),
    ("long_lighthouse", LONG_PROMPT),
    ("unicode_mixed", "Café, naïve, façade — 日本語のテキスト and emoji 🚀🌍 mean"),
    ("numbers_count", "1, 2, 3, 4, 5, 6,"),
    ("year_fact", "In 1969, the first humans to walk on the Moon were"),
    ("once_upon", "Once upon a time, in a small village by the river,"),
    ("json_snippet", '{"name": "Alice", "age": 30, "city": "'),
    ("question_sky", "Q: Why is the sky blue?\nA:"),
    ("german", "Der schnelle braune Fuchs springt über den"),
    # Beyond the window: the lighthouse text five times (~1,560 tokens) then a question.
    (
        "long_repeated",
        "\n\n".join([LONG_PROMPT] * 5) + "\n\nQuestion: what changed everything in 1822?\nAnswer:",
    ),
    ("long_register", _keeper_records()),
]

# One fixture set per model: (prompts, full-logit prompts, output stem, n_ctx, n_batch).
SETS = {
    "smollm2": (PROMPTS, FULL_LOGIT_PROMPTS, "llama_smollm2", N_CTX, N_BATCH),
    "gemma3": (
        GEMMA_PROMPTS,
        ["capital_france", "chat_2plus2", "long_repeated", "long_register"],
        "llama_gemma3",
        4096,
        2048,
    ),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_k(lp: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    # stable order: by logprob desc, then by id asc (deterministic on exact ties)
    idx = np.lexsort((np.arange(lp.shape[0]), -lp))[:k]
    return [int(i) for i in idx], [round(float(lp[i]), 6) for i in idx]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_src_info(src: str) -> dict:
    info: dict = {"source_dir": "<llama_cpp_python-0.3.36>/vendor/llama.cpp"}
    try:
        out = subprocess.run(
            ["git", "-C", src, "log", "-1", "--format=%H%n%cI%n%s"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        info.update(commit=out[0], commit_date=out[1], commit_subject=out[2])
    except (OSError, subprocess.CalledProcessError, IndexError):
        info["commit"] = "unknown"
    cache = Path(src) / "build" / "CMakeCache.txt"
    if cache.exists():
        flags = {}
        for line in cache.read_text().splitlines():
            if line.startswith(
                (
                    "GGML_NATIVE",
                    "GGML_AVX",
                    "GGML_AMX",
                    "GGML_FMA",
                    "GGML_F16C",
                    "GGML_BMI2",
                    "CMAKE_BUILD_TYPE",
                )
            ):
                k, _, v = line.partition("=")
                flags[k.split(":")[0]] = v
        info["cmake_flags"] = flags
    return info


def record(
    llm, n_vocab: int, prompts: list[tuple[str, str]], full_logit_prompts: list[str], n_batch: int
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Greedy runs of every prompt: the fixture records and the full-vocab logits."""
    records = []
    full_logits: dict[str, np.ndarray] = {}
    for name, text in prompts:
        toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert len(toks) < n_batch, "prompt must fit one batch"
        llm.reset()
        llm.eval(toks)
        logits = np.array(llm.scores[len(toks) - 1], dtype=np.float32)
        assert logits.shape == (n_vocab,)
        if name in full_logit_prompts:
            full_logits[name] = logits.astype(np.float16)
        gen: list[int] = []
        steps = []
        for step in range(N_GEN):
            lp = log_softmax(logits)
            ids, lps = top_k(lp, TOP_K)
            nxt = ids[0]
            steps.append({"top_ids": ids, "top_logprobs": lps})
            gen.append(nxt)
            if step + 1 < N_GEN:
                llm.eval([nxt])
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        records.append(
            {
                "name": name,
                "text": text,
                "prompt_tokens": [int(t) for t in toks],
                "greedy_tokens": gen,
                "greedy_text": llm.detokenize(gen).decode("utf-8", errors="replace"),
                "steps": steps,
            }
        )
        print(f"{name:20s} n_prompt={len(toks):4d} -> {records[-1]['greedy_text']!r}")
    return records, full_logits


def compare_runs(ref: list[dict], other: list[dict], n_top: int = 5) -> dict:
    """How far run ``other`` is from run ``ref`` (same prompts): per prompt the identical greedy
    prefix length, and over the positions both reach with the same context (up to and including
    the first divergence) the largest |logprob difference| of ``ref``'s top ``n_top`` tokens
    (where ``other`` recorded them; both record the top 10)."""
    prefixes, diffs, gaps = [], [], []
    for a, b in zip(ref, other, strict=True):
        assert a["name"] == b["name"]
        d = next(
            (
                i
                for i, (x, y) in enumerate(
                    zip(a["greedy_tokens"], b["greedy_tokens"], strict=False)
                )
                if x != y
            ),
            None,
        )
        prefixes.append(len(a["greedy_tokens"]) if d is None else d)
        last = len(a["greedy_tokens"]) - 1 if d is None else d
        for i in range(last + 1):
            sa, sb = a["steps"][i], b["steps"][i]
            theirs = dict(zip(sb["top_ids"], sb["top_logprobs"], strict=True))
            ds = [
                abs(lp - theirs[t])
                for t, lp in zip(sa["top_ids"][:n_top], sa["top_logprobs"][:n_top], strict=True)
                if t in theirs
            ]
            diffs.append(max(ds))
        if d is not None:
            step = a["steps"][d]
            theirs_tok = b["greedy_tokens"][d]
            mine = dict(zip(step["top_ids"], step["top_logprobs"], strict=True))
            gaps.append(
                round(step["top_logprobs"][0] - mine[theirs_tok], 6) if theirs_tok in mine else None
            )
    return {
        "greedy_prefix_lengths": prefixes,
        "greedy_prefix_mean": round(float(np.mean(prefixes)), 4),
        "greedy_full_matches": sum(p == N_GEN for p in prefixes),
        "divergence_gaps_nats": gaps,
        "top5_logprob_max": round(float(np.max(diffs)), 6),
        "top5_logprob_mean": round(float(np.mean(diffs)), 6),
        "n_positions": len(diffs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--set", choices=sorted(SETS), default="smollm2", help="which fixtures")
    ap.add_argument("--model", default=None, help="default: $KVSERVE_TEST_MODEL or $..._GEMMA")
    lib = os.environ.get("LLAMA_CPP_LIB_PATH")
    ap.add_argument(
        "--llama-src", default=str(Path(lib).parent.parent) if lib else None, help="llama.cpp tree"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--out-logits", default=None)
    ap.add_argument(
        "--flash-attn",
        choices=("off", "on"),
        default="off",
        help="llama.cpp's flash-attention kernel for the recorded data (default: off)",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="also run the other flash-attention setting and store how far it moves",
    )
    args = ap.parse_args()
    prompts, full_logit_prompts, stem, n_ctx, n_batch = SETS[args.set]
    env = "KVSERVE_TEST_GEMMA" if args.set == "gemma3" else "KVSERVE_TEST_MODEL"
    args.model = args.model or os.environ.get(env)
    args.out = args.out or str(OUT_JSON.parent / f"{stem}.json")
    args.out_logits = args.out_logits or str(OUT_JSON.parent / f"{stem}_logits.npz")
    if not args.model:
        ap.error(f"--model is required (or set {env})")
    if not lib:
        ap.error("set LLAMA_CPP_LIB_PATH to the llama.cpp build/bin directory holding libllama")

    import llama_cpp
    from llama_cpp import Llama

    def load(flash_attn: bool) -> Llama:
        return Llama(
            args.model,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            logits_all=True,
            flash_attn=flash_attn,
            verbose=False,
            seed=0,
        )

    llm = load(args.flash_attn == "on")
    n_vocab = llm.n_vocab()
    records, full_logits = record(llm, n_vocab, prompts, full_logit_prompts, n_batch)
    del llm
    calibration = None
    if args.calibrate:
        other = "off" if args.flash_attn == "on" else "on"
        print(f"calibration: flash attention {other}")
        other_records, _ = record(
            load(other == "on"), n_vocab, prompts, full_logit_prompts, n_batch
        )
        calibration = {"flash_attn": other, **compare_runs(records, other_records)}
        print(f"calibration: {json.dumps(calibration)}")

    Path(args.out_logits).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out_logits, **full_logits)

    meta = {
        "generator": "scripts/record_llama_fixtures.py",
        "command": (
            "LLAMA_CPP_LIB_PATH=<llama.cpp>/build/bin python scripts/record_llama_fixtures.py "
            f"--set {args.set} --model <{os.path.basename(args.model)}> "
            f"--flash-attn {args.flash_attn}" + (" --calibrate" if args.calibrate else "")
        ),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp": llama_src_info(args.llama_src) if args.llama_src else {"commit": "unknown"},
        "machine": platform.machine(),
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "n_vocab": n_vocab,
        "n_ctx": n_ctx,
        "n_batch": n_batch,
        "n_threads": N_THREADS,
        "n_gen": N_GEN,
        "top_k": TOP_K,
        "flash_attn": args.flash_attn,
        "tokenize": {"add_special": True, "parse_special": True},
        "sampling": (
            "argmax over raw logits (no sampler chain); "
            "logprobs = float64 log_softmax of raw logits"
        ),
        "decode_loop": "prompt evaluated in one call, then one token per call",
        "full_logits_file": os.path.basename(args.out_logits),
        "full_logits_prompts": full_logit_prompts,
        "full_logits_dtype": "float16, last prompt position",
    }
    if calibration is not None:
        meta["calibration"] = calibration
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "prompts": records}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(
        f"wrote {args.out} ({os.path.getsize(args.out)} B) and {args.out_logits} "
        f"({os.path.getsize(args.out_logits)} B)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
