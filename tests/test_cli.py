"""End-to-end tests of the ``kvserve`` command line (``python -m kvserve``) on a real model.

Oracles independent of the engine: token ids are checked against the GGUF vocabulary read with
the ``gguf`` package (pieces must spell the input text; special-token text must map to the id
of that token), and generated text must equal the bytes of the generated tokens' vocabulary
pieces. Error paths must print one ``kvserve: error:`` line and no traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_vocab import Vocab

import kvserve

PROMPT = "The capital of France is"


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for ``python -m kvserve``: the kvserve package this test process imports,
    no KVSERVE_DEBUG / KVSERVE_SIMD / KVSERVE_REPACK from the caller, plus ``extra``."""
    env = dict(os.environ)
    pkg_root = str(Path(kvserve.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    env.pop("KVSERVE_DEBUG", None)
    env.pop("KVSERVE_SIMD", None)
    env.pop("KVSERVE_REPACK", None)
    env.update(extra)
    return env


def run_cli(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvserve`` with the same kvserve package this test process imports."""
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *args],
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=cli_env() if env is None else env,
        timeout=600,
        check=False,
    )


def ok_json(*args: str) -> dict[str, object]:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    obj = json.loads(proc.stdout)
    assert isinstance(obj, dict)
    return obj


@pytest.fixture(scope="module", autouse=True)
def binding_built() -> None:
    try:
        import kvserve._core  # noqa: F401
    except ImportError as e:
        pytest.fail(f"kvserve._core is not built ({e}); run `pip install -e .` first")


# -- tokenize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [PROMPT, "Hello,  world!\n\tcafé 日本 🙂 1234567", " leading"])
def test_tokenize_json_spells_the_text(model_path: Path, vocab: Vocab, text: str) -> None:
    obj = ok_json("tokenize", "--model", str(model_path), "--json", text)
    assert list(obj) == ["tokens"]
    tokens = obj["tokens"]
    assert isinstance(tokens, list) and tokens
    assert all(isinstance(t, int) and 0 <= t < len(vocab.tokens) for t in tokens)
    expected = text if vocab.model == "gpt2" else " " + text  # SPM adds a space prefix
    assert vocab.text(tokens) == expected


def test_tokenize_parses_special_tokens(model_path: Path, vocab: Vocab) -> None:
    assert isinstance(vocab.bos, int)
    special = "<|im_start|>" if "<|im_start|>" in vocab.tokens else vocab.tokens[vocab.bos]
    obj = ok_json("tokenize", "--model", str(model_path), "--json", f"{special}user")
    tokens = obj["tokens"]
    assert isinstance(tokens, list)
    assert tokens[0] == vocab.tokens.index(special)
    assert vocab.text(tokens[1:]).strip() == "user"


def test_tokenize_add_special_follows_model_metadata(model_path: Path, vocab: Vocab) -> None:
    plain = ok_json("tokenize", "--model", str(model_path), "--json", PROMPT)["tokens"]
    special = ok_json("tokenize", "--model", str(model_path), "--json", "--add-special", PROMPT)[
        "tokens"
    ]
    assert isinstance(plain, list) and isinstance(special, list)
    if vocab.add_bos is not None:
        assert special == ([vocab.bos] if vocab.add_bos else []) + plain
    else:
        assert special[-len(plain) :] == plain


def test_tokenize_reads_stdin(model_path: Path) -> None:
    proc = run_cli("tokenize", "--model", str(model_path), "--json", "-", stdin=PROMPT)
    assert proc.returncode == 0, proc.stderr
    direct = ok_json("tokenize", "--model", str(model_path), "--json", PROMPT)
    assert json.loads(proc.stdout) == direct


# -- complete ---------------------------------------------------------------------------------
def test_complete_json_greedy(model_path: Path, vocab: Vocab) -> None:
    args = ("complete", "--model", str(model_path), "--max-tokens", "16", "--json", PROMPT)
    obj = ok_json(*args)
    assert sorted(obj) == ["text", "tokens"]
    text, tokens = obj["text"], obj["tokens"]
    assert isinstance(text, str) and isinstance(tokens, list)
    assert 1 <= len(tokens) <= 16
    assert vocab.text(tokens) == text  # generated tokens only, no prompt
    assert "Paris" in text
    # Greedy is deterministic, and a prompt of "-" is read from stdin.
    stdin = run_cli(*args[:-1], "-", stdin=PROMPT)
    assert stdin.returncode == 0, stdin.stderr
    assert json.loads(stdin.stdout) == obj


def test_complete_sampling_options_take_effect(model_path: Path) -> None:
    """A seed reproduces a sample; the sample is not the greedy text (so temperature and seed
    reach the sampler); ``--top-k 1`` leaves only the greedy token at every step."""
    base = ("complete", "--model", str(model_path), "--max-tokens", "12", "--json")
    sampled = (*base, "--temperature", "1.0", "--seed", "7")
    a = ok_json(*sampled, "Once upon a time")
    assert ok_json(*sampled, "Once upon a time") == a
    greedy = ok_json(*base, "Once upon a time")
    assert a["tokens"] != greedy["tokens"], "temperature 1.0 sampled exactly the greedy tokens"
    assert ok_json(*sampled, "--top-k", "1", "Once upon a time") == greedy


REPEAT_PROMPT = "red blue green, red blue green, red blue green, red"
CHAT_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
SAMPLED = {"temperature": 1.5, "seed": 1}


@pytest.mark.parametrize(
    ("flags", "options", "base"),
    [
        (["--min-p", "0.3"], {"min_p": 0.3}, SAMPLED),
        (["--typical-p", "0.5"], {"typical_p": 0.5}, SAMPLED),
        (["--repeat-penalty", "1.5"], {"repeat_penalty": 1.5}, {}),
        (
            ["--repeat-penalty", "1.5", "--repeat-last-n", "3"],
            {"repeat_penalty": 1.5, "penalty_last_n": 3},
            {},
        ),
        (["--presence-penalty", "1.5"], {"presence_penalty": 1.5}, {}),
        (["--frequency-penalty", "0.7"], {"frequency_penalty": 0.7}, {}),
        (
            ["--logit-bias", "2240=4.5", "--logit-bias", "4461=-inf"],  # 4461: " blue"
            {"logit_bias": {2240: 4.5, 4461: float("-inf")}},
            {},
        ),
    ],
)
def test_complete_bias_penalty_and_filter_flags_reach_their_options(
    model_path: Path, flags: list[str], options: dict[str, object], base: dict[str, object]
) -> None:
    """Each flag gives what ``Model.generate`` gives with its option (and something else
    than without it: the flag is not ignored)."""
    model = kvserve.Model.load(model_path, threads=2)
    want = model.generate(REPEAT_PROMPT, 12, **base, **options)  # type: ignore[arg-type]
    assert want.tokens != model.generate(REPEAT_PROMPT, 12, **base).tokens  # type: ignore[arg-type]
    base_flags = [f"--{k.replace('_', '-')}={v}" for k, v in base.items()]
    args = ("complete", "--model", str(model_path), "-n", "12", "--json", *base_flags, *flags)
    assert ok_json(*args, REPEAT_PROMPT) == {"text": want.text, "tokens": want.tokens}


def test_complete_ignore_eos_continues_past_the_end(model_path: Path, vocab: Vocab) -> None:
    base = ("complete", "--model", str(model_path), "-n", "12", "--json")
    stopped = ok_json(*base, CHAT_PROMPT)
    tokens = stopped["tokens"]
    assert isinstance(tokens, list) and len(tokens) < 12  # ends at <|im_end|>
    longer = ok_json(*base, "--ignore-eos", CHAT_PROMPT)["tokens"]
    assert isinstance(longer, list) and len(longer) == 12
    assert longer[: len(tokens)] == tokens and longer[len(tokens)] == vocab.eos


def _golden(name: str) -> dict[str, object]:
    """A prompt of the llama.cpp golden data (tests/fixtures/llama_smollm2.json)."""
    fixture = Path(__file__).parent / "fixtures" / "llama_smollm2.json"
    golden = json.loads(fixture.read_text(encoding="utf-8"))
    prompt = next(p for p in golden["prompts"] if p["name"] == name)
    assert isinstance(prompt, dict)
    return prompt


def test_complete_stop_cuts_before_the_stop_text(model_path: Path, vocab: Vocab) -> None:
    """Oracle: llama.cpp's greedy continuation of the prompt (the golden data), spelled with the
    GGUF vocabulary: the text ends right before the stop string, the tokens at the token that
    completed it."""
    golden = _golden("capital_france")
    assert golden["text"] == PROMPT
    ref = golden["greedy_tokens"]
    assert isinstance(ref, list)
    full = vocab.text(ref)
    stop = "United"
    n = next(k for k in range(1, len(ref) + 1) if stop in vocab.text(ref[:k]))
    obj = ok_json(
        "complete", "--model", str(model_path), "-n", "16", "--stop", "nowhere", "--stop", stop,
        "--json", PROMPT,
    )  # fmt: skip
    assert obj == {"text": full[: full.index(stop)], "tokens": ref[:n]}


def test_complete_stream_matches_json(model_path: Path) -> None:
    common = ("complete", "--model", str(model_path), "--max-tokens", "12", "--threads", "2")
    obj = ok_json(*common, "--json", PROMPT)
    proc = run_cli(*common, PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == obj["text"]


def test_complete_max_tokens_zero(model_path: Path) -> None:
    obj = ok_json("complete", "--model", str(model_path), "--max-tokens", "0", "--json", PROMPT)
    assert obj == {"text": "", "tokens": []}


# -- bench, info ------------------------------------------------------------------------------
def test_bench_json(model_path: Path) -> None:
    obj = ok_json(
        "bench", "--model", str(model_path), "--threads", "2", "-p", "16", "-n", "4", "--json"
    )
    assert {"prefill_tok_s", "decode_tok_s"} <= set(obj)
    for key in ("prefill_tok_s", "decode_tok_s"):
        value = obj[key]
        assert isinstance(value, float) and value > 0
    groups = obj["kv_groups"]
    assert isinstance(groups, list)
    (g,) = groups  # one sequence of 16 tokens: one block of the one group
    assert (g["kind"], g["blocks_held"], g["layers"]) == ("full", 1, 30)
    assert g["bytes_held"] == g["bytes_per_block"] and g["blocks_total"] > 1


def test_bench_reports_the_window_group_bounded_by_its_window(gemma_path: Path) -> None:
    """Gemma 3: after a 700-token prompt the full group holds all 44 blocks, the window
    group at most the 512-token window's ceil(512 / 16) + 1 = 33; the text output says so."""
    args = ["bench", "--model", str(gemma_path), "-p", "700", "-n", "1", "--reps", "1"]
    obj = ok_json(*args, "--json")
    groups = obj["kv_groups"]
    assert isinstance(groups, list)
    by_kind = {g["kind"]: g for g in groups}
    assert by_kind["full"]["blocks_held"] == 44 and by_kind["full"]["layers"] == 3
    assert by_kind["window"]["window"] == 512 and by_kind["window"]["layers"] == 15
    assert 32 <= by_kind["window"]["blocks_held"] <= 33
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "KV window 512 (15 layers): " in text and "KV full (3 layers): 44 blocks held" in text


def test_bench_depth(model_path: Path) -> None:
    """``-d``: the timed decode runs after 300 tokens of context (llama-bench's -d), so the
    sequence holds 300 + 4 tokens (19 blocks of 16) at the end; no prefill with -p 0."""
    args = ["bench", "--model", str(model_path), "-p", "0", "-n", "4", "-d", "300", "-r", "1"]
    obj = ok_json(*args, "--json")
    assert obj["depth"] == 300 and obj["prefill_tok_s"] == 0.0 and obj["decode_tok_s"] > 0
    (g,) = obj["kv_groups"]
    assert g["blocks_held"] == -(-304 // 16)
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "decode  (4 tokens after 300 tokens): " in proc.stdout
    assert "prefill" not in proc.stdout


def test_decode_copies_of_the_weights(model_path: Path) -> None:
    """The weight matrices' one-token decode copies (rust/core/src/quant/x16.rs): the bench
    reports their bytes (on an x86-64 CPU with AVX2 every SmolLM2 layer matrix and the output
    head; none elsewhere), ``KVSERVE_REPACK=0`` makes none and leaves the greedy tokens as
    they were, and any other value is a clear error."""
    level = subprocess.run(
        [sys.executable, "-c", "import kvserve._core as c; print(c.simd_level())"],
        capture_output=True,
        text=True,
        env=cli_env(),
        check=True,
    ).stdout.strip()
    d, kv, ff, layers, vocab = 576, 192, 1536, 30, 49152
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff
    # The Q4_1 layer matrices and the Q8_0 output head (the tied embedding, 34 bytes per 32).
    full = layers * per_layer // 32 * 20 + vocab * d // 32 * 34
    want = full if level in ("avx2", "avx512", "avx512vnni") else 0
    args = ["bench", "--model", str(model_path), "-p", "0", "-n", "2", "-r", "1", "--json"]
    assert ok_json(*args)["repacked_bytes"] == want
    off = run_cli(*args, env=cli_env(KVSERVE_REPACK="0"))
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["repacked_bytes"] == 0
    text = run_cli(*args[:-1])
    assert ("weights repacked for decode: " in text.stdout) == (want > 0), text.stdout
    complete = ["complete", "--model", str(model_path), "--max-tokens", "8", "--json"]
    prompt = "The capital of France is"
    on = ok_json(*complete, prompt)["tokens"]
    off = run_cli(*complete, prompt, env=cli_env(KVSERVE_REPACK="0"))
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["tokens"] == on
    bad = run_cli(*args, env=cli_env(KVSERVE_REPACK="yes"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert 'KVSERVE_REPACK="yes" is not valid' in bad.stderr, bad.stderr


def test_bench_batched_json(model_path: Path) -> None:
    obj = ok_json(
        "bench", "--model", str(model_path), "--batch", "1,3", "-p", "8", "-n", "2", "--json"
    )
    rows = obj["batches"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0


def test_complete_with_q8_0_kv_cache(model_path: Path) -> None:
    args = ["complete", "--model", str(model_path), "--max-tokens", "8", "--json"]
    f16 = ok_json(*args, "The capital of France is")
    q8 = ok_json(*args, "--kv-type", "q8_0", "The capital of France is")
    assert len(q8["tokens"]) == 8
    # Half-size K/V: the first greedy tokens agree on this prompt (measured; see test_kv_cache).
    assert q8["tokens"][:2] == f16["tokens"][:2]


def test_info(model_path: Path) -> None:
    proc = run_cli("info", "--model", str(model_path))
    assert proc.returncode == 0, proc.stderr
    assert "arch: llama" in proc.stdout
    obj = ok_json("info", "--model", str(model_path), "--json")
    assert obj["arch"] == "llama" and obj["n_vocab"] == 49152


# -- errors -----------------------------------------------------------------------------------
def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvserve: error: ")
    assert proc.stdout == ""
    return lines[0]


def _bad_files(tmp: Path, model_path: Path) -> dict[str, Path]:
    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    empty = tmp / "empty.gguf"
    empty.write_bytes(b"")
    bad_magic = tmp / "text.gguf"
    bad_magic.write_text("this is not a model\n")
    truncated = tmp / "truncated.gguf"
    with open(model_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))  # header + part of the tensor infos/data
    header_only = tmp / "header.gguf"
    with open(model_path, "rb") as f:
        header_only.write_bytes(f.read(24))
    return {
        "missing": tmp / "does-not-exist.gguf",
        "directory": tmp,
        "garbage": garbage,
        "empty": empty,
        "bad_magic": bad_magic,
        "truncated": truncated,
        "header_only": header_only,
    }


@pytest.mark.parametrize(
    "kind", ["missing", "directory", "garbage", "empty", "bad_magic", "truncated", "header_only"]
)
@pytest.mark.parametrize("command", ["tokenize", "complete", "info"])
def test_bad_model_file_is_one_line_error(
    tmp_path: Path, model_path: Path, kind: str, command: str
) -> None:
    path = _bad_files(tmp_path, model_path)[kind]
    extra = ["--json"] if command != "info" else []
    args = [command, "--model", str(path), *extra]
    if command != "info":
        args.append(PROMPT)
    line = assert_one_line_error(run_cli(*args))
    if kind in ("missing", "directory"):
        assert str(path) in line


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["bench", "--batch", "1,0"],
            "kvserve: error: argument --batch: expected a positive integer, got '0'",
        ),
        (
            ["bench", "--batch", "2", "-d", "64"],
            r"kvserve: error: bench: --depth is for one sequence \(with --batch, -p is the depth\)",
        ),
        (["bench", "-p", "0", "-n", "0"], r"kvserve: error: bench: nothing to measure .*"),
        (
            ["complete", "--threads", "0", "x"],
            "kvserve: error: argument -t/--threads: expected a positive integer, got '0'",
        ),
        (
            ["complete", "--kv-type", "q4", "x"],
            # argparse quotes the choices or not depending on the Python version
            r"kvserve: error: argument --kv-type: invalid choice: 'q4' "
            r"\(choose from '?f16'?, '?q8_0'?, '?f32'?\)",
        ),
        (["complete"], "kvserve: error: the following arguments are required: PROMPT"),
        (
            ["complete", "--logit-bias", "13", "x"],
            "kvserve: error: argument --logit-bias: expected TOKEN=BIAS .*, got '13'",
        ),
        (
            ["complete", "--logit-bias", "a=1", "x"],
            "kvserve: error: argument --logit-bias: expected TOKEN=BIAS .*, got 'a=1'",
        ),
        (["frobnicate"], r"kvserve: error: argument COMMAND: invalid choice: 'frobnicate' .*"),
    ],
)
def test_usage_errors_are_one_line_status_1(args: list[str], line: str) -> None:
    """Values argparse rejects follow the same contract as every other error (not argparse's
    usage text and status 2)."""
    got = assert_one_line_error(run_cli(*args))
    assert re.fullmatch(line, got), got


def test_kvserve_debug_shows_the_traceback(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    plain = assert_one_line_error(run_cli("info", "--model", missing))
    debug = run_cli("info", "--model", missing, env=cli_env(KVSERVE_DEBUG="1"))
    assert debug.returncode == 1
    assert debug.stderr.startswith("Traceback (most recent call last):"), debug.stderr
    # The exception's own line carries the same message as the one-line error.
    message = plain.removeprefix("kvserve: error: ")
    assert debug.stderr.splitlines()[-1] == f"kvserve.ModelError: {message}"


def test_invalid_kvserve_simd_is_one_line_error(model_path: Path) -> None:
    proc = run_cli(
        "complete", "--model", str(model_path), "--json", PROMPT, env=cli_env(KVSERVE_SIMD="avx9")
    )
    assert assert_one_line_error(proc) == (
        "kvserve: error: KVSERVE_SIMD='avx9' is not a SIMD level; "
        "valid values: scalar, neon, avx2, avx512, avx512vnni"
    )


def test_closed_pipe_ends_quietly(model_path: Path) -> None:
    """``kvserve complete ... | head -c1``: the reader leaves after one byte while tokens are
    still coming; the command ends with status 141 (128 + SIGPIPE) and says nothing."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "complete", "--model", str(model_path), "-n", "64",
         "Once upon a time"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(1)
    proc.stdout.close()
    status = proc.wait(timeout=600)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert len(first) == 1
    assert (status, err) == (141, "")


def test_bad_argument_values_are_one_line_errors(model_path: Path) -> None:
    proc = run_cli("complete", "--model", str(model_path), "--temperature", "-1", "--json", PROMPT)
    assert "temperature" in assert_one_line_error(proc)
    proc = run_cli("complete", "--model", str(model_path), "--top-p", "0", "--json", PROMPT)
    assert "top_p" in assert_one_line_error(proc)
    for flags, name in (
        (["--typical-p", "0"], "typical_p"),
        (["--repeat-penalty", "0"], "repeat_penalty"),
        (["--repeat-last-n", "-2"], "penalty_last_n"),
        (["--presence-penalty", "5"], "presence_penalty"),
        (["--logit-bias", "999999=1"], "logit_bias"),
        (["--logit-bias", "13=inf"], "logit_bias"),
    ):
        proc = run_cli("complete", "--model", str(model_path), *flags, "--json", PROMPT)
        assert name in assert_one_line_error(proc), flags


def test_bad_kvserve_threads_env_is_one_line_error(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_THREADS", "lots")
    proc = run_cli("complete", "--model", str(model_path), "--json", PROMPT)
    assert "KVSERVE_THREADS" in assert_one_line_error(proc)


def test_undecodable_argument_bytes_are_one_line_error(model_path: Path) -> None:
    """A Latin-1 byte in the argument (Python keeps it as a lone surrogate) has no UTF-8 form."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "tokenize", "--model", str(model_path), b"caf\xe9"],
        capture_output=True,
        env=cli_env(),
        timeout=600,
        check=False,
    )
    err = proc.stderr.decode()
    assert (proc.returncode, proc.stdout, err.count("\n")) == (1, b"", 1), err
    assert err == (
        "kvserve: error: 'utf-8' codec can't encode character '\\udce9' in position 3: "
        "surrogates not allowed\n"
    )


def test_context_too_small_is_one_line_error(model_path: Path) -> None:
    proc = run_cli("complete", "--model", str(model_path), "-c", "2", "--json", PROMPT)
    assert_one_line_error(proc)
