#!/usr/bin/env python3
"""Record llama.cpp tokenizer goldens for kvserve's tokenizer tests.

For each model, runs llama.cpp's own tokenizer (libllama through the `llama_cpp` ctypes
binding, pointed at a llama.cpp build with LLAMA_CPP_LIB_PATH) over a fixed corpus with every
combination of add_special / parse_special, and writes

    tests/fixtures/tokenizer/<name>.json
    {"model": ..., "llama_cpp": ..., "cases": [{"text", "add_special", "parse_special",
      "tokens", "decoded_hex"}], "pieces": [{"id", "special", "piece_hex"}]}

`decoded_hex` is llama_detokenize(tokens, remove_special=false, unparse_special=false) as hex
(the bytes need not be UTF-8); `pieces` holds llama_token_to_piece(id, lstrip=0, special) for a
sample of ids. The corpus includes texts of whitespace only and, with add_special and
parse_special both off, three texts of 10,000 characters (long_texts()). With --pre-variants,
the SmolLM2 vocabulary is also recorded under the pre-tokenizers in PRE_VARIANTS
(smollm2-pre-<pre>.json, with "pre_override"; no pieces).

Lone surrogates are not recorded: they have no UTF-8 form, so kvserve (like `str.encode`)
rejects them, while llama.cpp, given their surrogate-escaped bytes, tokenizes those bytes.
With --cross-check-cli the script also runs the `llama-tokenize` binary on every
case and fails if its ids differ from the library's.

Usage (scripts/build_llama_cpp.sh builds llama.cpp and the binding; `source <LLAMA_DIR>/env.sh`
then sets LLAMA_CPP_LIB_PATH, and LLAMA_CPP_BIN_DIR for --cross-check-cli):
  LLAMA_CPP_LIB_PATH=<llama.cpp>/build/bin python scripts/record_tokenizer_fixtures.py \
      --smollm2 <SmolLM2-135M-Instruct.Q4_1.gguf> \
      --gemma3 <gemma-3-270m-q4_k_m.gguf> --pre-variants \
      [--cross-check-cli <llama.cpp>/build/bin]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "tokenizer"

CORPUS: list[str] = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "Hello",
    "Hello world",
    " Hello world",
    "Hello world!",
    "hello, world. How are you?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you've seen it; they'll say we'd done it, she's here.",
    "I'M SURE YOU'VE SEEN IT, THEY'LL SAY WE'D DONE IT, SHE'S HERE",
    "don't won't can't isn't 'quoted' ' s",
    "1234567",
    "3.14159 and 2,718,281 and 1e-9 and -42",
    "Numbers: 0 12 123 1234 12345 123456",
    "\u0661\u0662\u0663 Arabic-Indic digits and \u00bd \u2163 fractions",
    "multiple   spaces    here",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\nline4\n\n\n",
    "windows\r\nline\r\nendings",
    " \n \n  \n",
    "mixed \t \n whitespace \u00a0 nbsp \u3000 ideographic",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "e\u0301 combining accent",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "emoji \U0001f600\U0001f389\U0001f44d\U0001f3fd and "
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "\u2764\ufe0f\u2728\u2b50",
    "mixed: English \u4e2d\u6587 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 123",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "if x == 1:\n\tprint('one')\nelse:\n\tprint(\"other\")",
    "<html><body><h1>Title</h1></body></html>",
    "https://example.com/path?query=1&b=2#frag",
    "user@example.com, @handle #hashtag $100 50% a+b=c ~x^y `code` |pipe|",
    "!!!??? ... ,,, ;;; --- ___ ***",
    "\"quoted\" 'single' \u201csmart\u201d \u2018quotes\u2019 \u00abguillemets\u00bb",
    "CamelCaseWord snake_case_word kebab-case-word",
    "A\u2019s and A's and \u02bcs",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text <|endoftext|> more <|im_end|>",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos> <pad> <unk>",
    "</s> and <s>",
    "<|im_start|><|im_start|>",
    "<|im_start",
    "\u2581already escaped \u2581\u2581 markers",
    "zero\u200bwidth\u200cjoiners\u200d",
    "\ufeffBOM at start",
    "control \x01\x02\x7f chars",
    "\U00010348 gothic \U0001d400 math \U00020000 cjk-ext",
    "it'S THEY'RE we'Ll YOU'vE 'd",
    "x  \r\n\r\n  y",
    "end.\n\n\nNext!!\n\n?",
    "a\u2003\u2003b \u00a0\u00a0c 1\u00a02",
    "a" * 64,
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    # whitespace only
    "\n\n\n\n",
    "\t\t\t",
    "\r\n\r\n",
    " " * 17,
    "\n " * 5,
    " \t\n\r\n\u00a0",
    "\u3000\u2003\u00a0 \u2009",
    "\u200b\u200b",
]


def long_texts() -> list[str]:
    """Three texts of 10,000 characters: pieces of the fuzz alphabet drawn at random (fixed
    seed), one run of spaces, and prose with numbers and non-Latin scripts."""
    import random

    rng = random.Random(4321)
    fuzz = ""
    while len(fuzz) < 10_000:
        fuzz += rng.choice(FUZZ_PIECES)
    prose = (
        "In 1822 the Fresnel lens changed lighthouses: 1,000 prisms, 20 miles of light. "
        "Caf\u00e9 \u4e16\u754c \u041f\u0440\u0438\u0432\u0435\u0442 \U0001f30d, "
        "don't stop -- it's 3.14159!\n"
    )
    return [fuzz[:10_000], " " * 10_000, (prose * (10_000 // len(prose) + 1))[:10_000]]


# Pre-tokenizers exercised on the SmolLM2 vocabulary (tokenizer.ggml.pre swapped in a
# metadata-only copy of the GGUF), so every supported split family has a llama.cpp golden.
PRE_VARIANTS = ["llama-bpe", "qwen2", "default", "gpt-2"]

FLAGS = [(False, False), (True, False), (False, True), (True, True)]

# Randomized cases (fixed seed): short strings drawn from pieces that stress the
# pre-tokenizer rules (whitespace kinds, contractions, digits, scripts, special-token texts).
FUZZ_PIECES = [
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "\u00a0",
    "\u3000",
    "\u2003",
    "a",
    "b",
    "Z",
    "hello",
    "World",
    "THE",
    "x",
    "0",
    "7",
    "42",
    "123",
    "2024",
    "\u0663",
    "\u00bd",
    "\u2167",
    "'",
    "'s",
    "'S",
    "'t",
    "'re",
    "'VE",
    "'ll",
    "'d",
    "'m",
    "'x",
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    '"',
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "<",
    ">",
    "|",
    "`",
    "~",
    "^",
    "$",
    "+",
    "=",
    "-",
    "_",
    "*",
    "&",
    "%",
    "#",
    "@",
    "/",
    "\\",
    "...",
    "--",
    "\u00e9",
    "\u00df",
    "na\u00efve",
    "\u4e2d\u6587",
    "\u65e5",
    "\u0645\u0631\u062d\u0628\u0627",
    "\u05e9\u05dc\u05d5\u05dd",
    "\u041f\u0440\u0438",
    "\U0001f600",
    "\U0001f44d\U0001f3fd",
    "\u2764\ufe0f",
    "\u0301",
    "\u200d",
    "\u200b",
    "\u2581",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<start_of_turn>",
    "</s>",
    "<bos>",
    "<table>",
    "<|im_start",
    "im_end|>",
]
N_FUZZ = 300


def fuzz_cases() -> list[tuple[str, bool, bool]]:
    import random

    rng = random.Random(1234)
    out = []
    for i in range(N_FUZZ):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 24)))
        flags = FLAGS[i % len(FLAGS)]
        out.append((text, *flags))
    return out


def load_lib():
    if "LLAMA_CPP_LIB_PATH" not in os.environ:
        sys.exit("set LLAMA_CPP_LIB_PATH to the llama.cpp build/bin directory holding libllama.so")
    import llama_cpp.llama_cpp as L

    L.llama_backend_init()
    return L


class Vocab:
    def __init__(self, L, path: str):
        self.L = L
        params = L.llama_model_default_params()
        params.vocab_only = True
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            sys.exit(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = len(text) + 16
        buf = (self.L.llama_token * n_max)()
        n = self.L.llama_tokenize(
            self.vocab, text, len(text), buf, n_max, add_special, parse_special
        )
        if n < 0:
            n_max = -n
            buf = (self.L.llama_token * n_max)()
            n = self.L.llama_tokenize(
                self.vocab, text, len(text), buf, n_max, add_special, parse_special
            )
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> bytes:
        arr = (self.L.llama_token * max(1, len(tokens)))(*tokens)
        cap = 64 + 16 * len(tokens)
        out = ctypes.create_string_buffer(cap)
        n = self.L.llama_detokenize(self.vocab, arr, len(tokens), out, cap, False, False)
        if n < 0:
            cap = -n
            out = ctypes.create_string_buffer(cap)
            n = self.L.llama_detokenize(self.vocab, arr, len(tokens), out, cap, False, False)
        return out.raw[:n]

    def piece(self, tid: int, special: bool) -> bytes:
        out = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, tid, out, 256, 0, special)
        if n < 0:
            out = ctypes.create_string_buffer(-n)
            n = self.L.llama_token_to_piece(self.vocab, tid, out, -n, 0, special)
        return out.raw[:n]


def cli_tokenize(bin_dir: str, model: str, text: bytes, add_special: bool, parse_special: bool):
    cmd = [
        os.path.join(bin_dir, "llama-tokenize"),
        "-m",
        model,
        "--stdin",
        "--ids",
        "--log-disable",
        "--no-escape",
    ]
    if not add_special:
        cmd.append("--no-bos")
    if not parse_special:
        cmd.append("--no-parse-special")
    res = subprocess.run(cmd, input=text, capture_output=True, check=True)
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


def make_pre_variant(src: str, dst: str, pre: str) -> None:
    """Copy the metadata (no tensors) of `src` to `dst` with tokenizer.ggml.pre = `pre`."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        val = pre if k == "tokenizer.ggml.pre" else f.contents()
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(k, val, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, val, f.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def record(
    L, name: str, path: str, cli_bin: str | None, with_pieces: bool = True, pre: str | None = None
) -> None:
    v = Vocab(L, path)
    cases = []
    mismatches = 0
    todo = [(t, a, p) for t in CORPUS for a, p in FLAGS] + fuzz_cases()
    todo += [(t, False, False) for t in long_texts()]
    for text, add_special, parse_special in todo:
        raw = text.encode("utf-8")
        toks = v.tokenize(raw, add_special, parse_special)
        if cli_bin is not None and raw:
            cli = cli_tokenize(cli_bin, path, raw, add_special, parse_special)
            # llama-tokenize --no-bos only suppresses the BOS; compare like for like
            if cli != toks:
                mismatches += 1
                print(
                    f"CLI mismatch {name} {text!r} {add_special} {parse_special}: {cli} vs {toks}"
                )
        cases.append(
            {
                "text": text,
                "add_special": add_special,
                "parse_special": parse_special,
                "tokens": toks,
                "decoded_hex": v.detokenize(toks).hex(),
            }
        )
    # sample of ids for token_to_piece: the first 300, every 997th, and the last 50
    ids = sorted(
        set(range(min(300, v.n_vocab)))
        | set(range(0, v.n_vocab, 997))
        | set(range(max(0, v.n_vocab - 50), v.n_vocab))
    )
    pieces = []
    for tid in ids if with_pieces else []:
        for special in (False, True):
            pieces.append({"id": tid, "special": special, "piece_hex": v.piece(tid, special).hex()})
    doc = {
        "model": os.path.basename(path),
        "llama_cpp": "llama.cpp vendored in llama_cpp_python 0.3.36 "
        "(libllama llama_tokenize/llama_detokenize)",
        "n_vocab": v.n_vocab,
        "pre_override": pre,
        "cases": cases,
        "pieces": pieces,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"{name}.json"
    out.write_text(json.dumps(doc, ensure_ascii=True, indent=0) + "\n")
    print(
        f"wrote {out}: {len(cases)} cases, {len(pieces)} pieces"
        + (f", {mismatches} CLI mismatches" if cli_bin else "")
    )
    if mismatches:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smollm2", help="SmolLM2 GGUF (gpt2 BPE, pre smollm)")
    ap.add_argument("--gemma3", help="Gemma 3 GGUF (llama/SPM)")
    ap.add_argument(
        "--pre-variants",
        action="store_true",
        help="also record the SmolLM2 vocabulary under other tokenizer.ggml.pre values",
    )
    ap.add_argument("--cross-check-cli", metavar="BIN_DIR", help="also compare with llama-tokenize")
    args = ap.parse_args()
    L = load_lib()
    if args.smollm2:
        record(L, "smollm2", args.smollm2, args.cross_check_cli)
    if args.smollm2 and args.pre_variants:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for pre in PRE_VARIANTS:
                dst = os.path.join(tmp, f"smollm2-{pre}.gguf")
                make_pre_variant(args.smollm2, dst, pre)
                record(
                    L, f"smollm2-pre-{pre}", dst, args.cross_check_cli, with_pieces=False, pre=pre
                )
    if args.gemma3:
        record(L, "gemma3", args.gemma3, args.cross_check_cli)


if __name__ == "__main__":
    main()
