"""Writes the seed corpora of the fuzz targets under ``fuzz/corpus/<target>/``.

Seeds come from the real models (``KVSERVE_TEST_MODEL``: SmolLM2, ``KVSERVE_TEST_GEMMA``:
Gemma 3) kept small, and from the malformed shapes the test suite writes:

- ``gguf``: tiny models (tests/reference.py's writer) carrying each real model's vocabulary
  cut to its first tokens, the tiny synthetic vocabulary, and broken copies (truncated, bad
  magic or version, absurd counts, an unknown value type, a tensor past the end);
- ``tokenizer``: texts and token ids of the recorded tokenizer fixtures (one selector byte
  first, see fuzz_targets/tokenizer.rs);
- ``session_state``: states read from real contexts after decoding a few tokens (and an
  empty one), plus truncated and corrupted copies;
- ``request``: request bodies of every kind the server parses (see fuzz/python/fuzz_request.py).

Usage: ``python fuzz/make_seeds.py [TARGET...]`` (default: every target). Existing files of a
target are kept; seeds are named by content.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
MODELS = Path.home() / ".cache" / "kvserve" / "models"
SMOLLM2 = Path(os.environ.get("KVSERVE_TEST_MODEL", MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"))
GEMMA = Path(os.environ.get("KVSERVE_TEST_GEMMA", MODELS / "gemma-3-270m-q4_k_m.gguf"))
# Tokens of a real vocabulary kept in a tiny model's copy (ids of the special tokens included).
KEEP_TOKENS = 400
PROMPT = "The capital of France is"


def put(target: str, data: bytes, tag: str) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{tag}-{hashlib.sha1(data).hexdigest()[:12]}").write_bytes(data)


def _cut_tokenizer(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """The ``tokenizer.*`` keys of ``path`` with the vocabulary cut to its first tokens (and
    the merges among them); no chat template."""
    sys.path.insert(0, str(ROOT / "tests"))
    from reference import tokenizer_fields

    out = []
    fields = tokenizer_fields(path)
    tokens = next(v for k, v, _t, _s in fields if k == "tokenizer.ggml.tokens")[:KEEP_TOKENS]
    kept = set(tokens)
    for key, value, vtype, sub in fields:
        if key == "tokenizer.chat_template":
            continue
        if key == "tokenizer.ggml.merges":
            value = [
                m
                for m in value
                if len(m.split(" ")) == 2
                and all(p in kept for p in m.split(" "))
                and m.replace(" ", "") in kept
            ]
        elif key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            value = value[:KEEP_TOKENS]
        out.append((key, value, vtype, sub))
    return out


def gguf_seeds() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from reference import Spec, write_model

    specs: list[tuple[str, Spec, Path | None]] = [
        (
            "llama-smollm2-vocab",
            Spec(n_embd=32, n_head=2, n_head_kv=1, n_layer=1, n_ff=32, wtype="Q8_0"),
            SMOLLM2,
        ),
        (
            "gemma3-gemma-vocab",
            Spec(
                arch="gemma3",
                n_embd=32,
                n_head=2,
                n_head_kv=1,
                n_layer=2,
                n_ff=32,
                wtype="Q8_0",
                window=4,
                swa_pattern=2,
                freq_base_swa=10000.0,
            ),
            GEMMA,
        ),
        (
            "llama-tiny-vocab",
            Spec(n_embd=32, n_head=2, n_head_kv=2, n_layer=1, n_ff=32, wtype="Q8_0", tied=False),
            None,
        ),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for tag, spec, vocab in specs:
            p = Path(tmp) / f"{tag}.gguf"
            write_model(p, spec, None if vocab is None else _cut_tokenizer(vocab))
            data = p.read_bytes()
            put("gguf", data, tag)
            if tag != "llama-smollm2-vocab":
                continue
            # The malformed shapes tests write (rust/core/src/gguf/tests.rs, test_model_load.py).
            put("gguf", data[: len(data) // 2], "truncated-half")
            put("gguf", data[:24], "header-only")
            put("gguf", b"GGUX" + data[4:], "bad-magic")
            put("gguf", data[:4] + struct.pack("<I", 1) + data[8:], "version-1")
            put("gguf", data[:8] + struct.pack("<Q", 1 << 60) + data[16:], "absurd-tensor-count")
            put("gguf", data[:16] + struct.pack("<Q", 1 << 60) + data[24:], "absurd-kv-count")
            # the first key's value type (after the u64 key length and the key) made unknown
            klen = struct.unpack_from("<Q", data, 24)[0]
            at = 32 + klen
            put("gguf", data[:at] + struct.pack("<I", 99) + data[at + 4 :], "unknown-type")
    empty = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
    put("gguf", empty, "empty-v3")
    put("gguf", b"GGUF" + struct.pack("<IQQ", 2, 0, 0), "empty-v2")


def tokenizer_seeds() -> None:
    fixtures = ROOT / "tests" / "fixtures" / "tokenizer"
    for name, model_bit in (("smollm2.json", 0), ("gemma3.json", 1)):
        cases = json.loads((fixtures / name).read_text())["cases"]
        texts = [c for c in cases if len(c["text"].encode()) <= 512]
        for i, c in enumerate(texts[::3]):
            text = c["text"].encode()
            parse = 2 if c["parse_special"] else 0
            add = 8 if c["add_special"] else 0
            put("tokenizer", bytes([model_bit | parse | add]) + text, f"text{model_bit}")
            if i % 4 == 0:
                ids = b"".join(struct.pack("<I", t) for t in c["tokens"][:128])
                put("tokenizer", bytes([model_bit | 4]) + ids, f"ids{model_bit}")
    put("tokenizer", bytes([4]) + struct.pack("<3I", 0, 49151, 1 << 31), "ids-range0")
    put("tokenizer", bytes([5]) + struct.pack("<3I", 0, 262143, 1 << 31), "ids-range1")


def session_state_seeds() -> None:
    sys.path.insert(0, str(ROOT / "python"))
    from kvserve import _core

    for tag, path in (("smollm2", SMOLLM2), ("gemma3", GEMMA)):
        model = _core.Model(str(path), threads=1)
        ctx = model.new_context(n_ctx=256)
        toks = model.tokenize(PROMPT, add_special=True, parse_special=False)
        for n in (1, len(toks)):
            ctx.clear()
            ctx.decode(toks[:n], list(range(n)), [0] * n, [False] * (n - 1) + [True])
            data = ctx.seq_state_read(0)
            put("session_state", data, f"{tag}-{n}tok")
            if n == 1:
                put("session_state", data[: len(data) - 7], f"{tag}-truncated")
                put("session_state", data[:4] + struct.pack("<I", 9) + data[8:], f"{tag}-version")
                put("session_state", data + b"\0", f"{tag}-trailing")
        put("session_state", ctx.seq_state_read(7), f"{tag}-empty")


def request_seeds() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    bodies: list[tuple[int, Any]] = [
        (
            0,
            {
                "prompt": "Hello",
                "max_tokens": 8,
                "temperature": 0.7,
                "top_p": 0.9,
                "seed": 1,
                "stop": ["\n"],
                "logit_bias": {"42": -5.0},
                "logprobs": 2,
                "n": 2,
            },
        ),
        (
            0,
            {
                "prompt": [[1, 2, 3], [4]],
                "echo": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            0,
            {
                "prompt": ["a", "b"],
                "priority": 3,
                "cache_salt": "s",
                "session_id": "chat-1",
                "context_shift": True,
                "n_keep": 4,
                "repeat_last_n": 64,
                "repetition_penalty": 1.1,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.5,
                "typical_p": 0.9,
                "min_p": 0.05,
                "top_k": 40,
                "ignore_eos": True,
            },
        ),
        (0, {"prompt": "x", "temperature": -1}),
        (0, {"prompt": "x", "logit_bias": {"abc": 1}}),
        (
            1,
            {
                "messages": msgs,
                "max_completion_tokens": 16,
                "logprobs": True,
                "top_logprobs": 3,
                "user": "u",
                "model": "m",
            },
        ),
        (
            1,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "n"}
                ]
            },
        ),
        (1, {"messages": []}),
        (
            2,
            {
                "content": "Hello <|im_start|>",
                "add_special": True,
                "parse_special": False,
                "with_pieces": True,
            },
        ),
        (3, {"tokens": [1, 2, 3, -1]}),
        (4, {"messages": msgs}),
        (5, {"id": "session-1", "session_id": "other"}),
        (5, {"id": "../etc/passwd"}),
    ]
    for kind, body in bodies:
        put("request", bytes([kind]) + json.dumps(body).encode(), f"kind{kind}")
    for raw in (b"\0{", b"\1[]", b"\2null", b'\0{"prompt": "\\ud800"}', b"\0" + b"[" * 64):
        put("request", raw, "malformed")


TARGETS = {
    "gguf": gguf_seeds,
    "tokenizer": tokenizer_seeds,
    "session_state": session_state_seeds,
    "request": request_seeds,
}


def main(argv: list[str]) -> int:
    for name in argv or list(TARGETS):
        TARGETS[name]()
        d = CORPUS / name
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{name}: {len(list(d.iterdir()))} seeds, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
