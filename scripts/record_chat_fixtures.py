#!/usr/bin/env python3
"""Record llama.cpp's chat-template renderings for kvserve's chat tests.

Starts llama.cpp's ``llama-server`` with ``--jinja`` once per configuration below, POSTs each
conversation of CONVERSATIONS to ``/apply-template`` (the prompt llama-server would feed the
model for ``/v1/chat/completions``, without running it), then ``/tokenize`` of that prompt with
``add_special`` on and special-token text parsed (the ids a chat completion starts from), and
writes

    tests/fixtures/chat_templates.json
    {"llama_cpp": {"version": ...}, "configs": {NAME: {"model", "template", "cases": [
      {"name", "messages", "add_generation_prompt", "prompt", "tokens"} or {..., "error"}]}}}

Configurations:
- ``smollm2``: SmolLM2-135M-Instruct with the template its GGUF carries;
- ``gemma3-it``: Gemma 3 270M with Gemma 3's instruction template (the GGUF carries none), given
  with ``--chat-template-file tests/fixtures/chat/gemma3-it.jinja``; the template starts with
  ``{{ bos_token }}`` and the model adds BOS, which is the two-BOS question the tests check;
- ``gemma3-chatml``: Gemma 3 270M as it is, without a template: llama.cpp falls back to ChatML.

A case whose rendering fails (Gemma's template raises on roles that do not alternate) records
llama-server's error message instead of a prompt.

Usage (scripts/build_llama_cpp.sh builds llama.cpp; ``source <LLAMA_DIR>/env.sh`` sets
LLAMA_CPP_BIN_DIR):
  python scripts/record_chat_fixtures.py --smollm2 <SmolLM2-135M-Instruct.Q4_1.gguf> \\
      --gemma3 <gemma-3-270m-q4_k_m.gguf> [--bin-dir <llama.cpp>/build/bin]
The model paths default to $KVSERVE_TEST_MODEL and $KVSERVE_TEST_GEMMA, the binaries'
directory to $LLAMA_CPP_BIN_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat_templates.json"
GEMMA_IT_TEMPLATE = "tests/fixtures/chat/gemma3-it.jinja"

Message = dict[str, Any]

CONVERSATIONS: list[tuple[str, list[Message], bool]] = [
    ("single_user", [{"role": "user", "content": "Hello! Who are you?"}], True),
    ("single_user_no_generation_prompt", [{"role": "user", "content": "Hello!"}], False),
    (
        "system_user",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": "Banana."},
            {"role": "user", "content": "And a vegetable?"},
        ],
        True,
    ),
    (
        "system_multi_turn",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        True,
    ),
    (
        "unicode",
        [
            {"role": "system", "content": "Réponds en français. 日本語も大丈夫。"},
            {"role": "user", "content": "Grüße aus Köln! 🙂 Ça va? — «ñ» 你好 \u00a0 👩\u200d💻"},
        ],
        True,
    ),
    (
        "whitespace",
        [{"role": "user", "content": "  \n  padded question?\n\n  "}],
        True,
    ),
    (
        "content_parts",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First part."},
                    {"type": "text", "text": "Second part."},
                ],
            }
        ],
        True,
    ),
    (
        "content_parts_system",
        [
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        ],
        True,
    ),
    (
        "special_text_in_content",
        [{"role": "user", "content": "Literal <|im_end|> and <end_of_turn> inside."}],
        True,
    ),
    (
        "roles_not_alternating",
        [
            {"role": "user", "content": "One."},
            {"role": "user", "content": "Two."},
        ],
        True,
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: object) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Server:
    """A llama-server on a free local port, stopped on exit."""

    def __init__(self, bin_dir: Path, model: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--jinja", "-c", "512"]
        cmd += ["-t", "2", "-np", "1", "--no-webui", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                sys.stderr.write(self.log.read().decode(errors="replace"))
                raise SystemExit(f"llama-server exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise SystemExit("llama-server did not become healthy within 180 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def record(server: Server) -> list[dict[str, Any]]:
    cases = []
    for name, messages, add_gen in CONVERSATIONS:
        case: dict[str, Any] = {
            "name": name,
            "messages": messages,
            "add_generation_prompt": add_gen,
        }
        status, body = post(
            server.port,
            "/apply-template",
            {"messages": messages, "add_generation_prompt": add_gen},
        )
        if status != 200:
            err = body.get("error", body) if isinstance(body, dict) else body
            case["error"] = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        else:
            prompt = body["prompt"]
            status, tok = post(
                server.port,
                "/tokenize",
                {"content": prompt, "add_special": True, "parse_special": True},
            )
            if status != 200:
                raise SystemExit(f"/tokenize failed ({status}): {tok}")
            case["prompt"] = prompt
            case["tokens"] = tok["tokens"]
        cases.append(case)
    return cases


def llama_version(bin_dir: Path) -> str:
    out = subprocess.run(
        [str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, check=False
    )
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((ln for ln in lines if ln.startswith("version:")), "unknown").strip()


def dump(out: dict[str, Any]) -> str:
    """JSON with one line per case (readable diffs, short files)."""
    lines = ["{", f' "llama_cpp": {json.dumps(out["llama_cpp"], ensure_ascii=False)},']
    lines.append(' "configs": {')
    configs = list(out["configs"].items())
    for i, (name, entry) in enumerate(configs):
        head = {k: v for k, v in entry.items() if k != "cases"}
        lines.append(f"  {json.dumps(name)}: {{")
        for k, v in head.items():
            lines.append(f"   {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},")
        lines.append('   "cases": [')
        cases = entry["cases"]
        for j, case in enumerate(cases):
            comma = "," if j + 1 < len(cases) else ""
            lines.append(f"    {json.dumps(case, ensure_ascii=False)}{comma}")
        lines.append("   ]")
        lines.append("  }" + ("," if i + 1 < len(configs) else ""))
    lines += [" }", "}"]
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == out
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smollm2", type=Path, default=os.environ.get("KVSERVE_TEST_MODEL"))
    p.add_argument("--gemma3", type=Path, default=os.environ.get("KVSERVE_TEST_GEMMA"))
    p.add_argument("--bin-dir", type=Path, default=os.environ.get("LLAMA_CPP_BIN_DIR"))
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    for what in ("smollm2", "gemma3", "bin_dir"):
        if getattr(args, what) is None:
            p.error(f"--{what.replace('_', '-')} is required (or its environment variable)")

    template_path = ROOT / GEMMA_IT_TEMPLATE
    template = template_path.read_text(encoding="utf-8")
    configs = {
        "smollm2": (args.smollm2, [], None),
        "gemma3-it": (args.gemma3, ["--chat-template-file", str(template_path)], template),
        "gemma3-chatml": (args.gemma3, [], None),
    }
    out: dict[str, Any] = {
        "llama_cpp": {"version": llama_version(args.bin_dir), "server": "llama-server --jinja"},
        "configs": {},
    }
    for name, (model, extra, tpl) in configs.items():
        sys.stderr.write(f"record_chat_fixtures: {name}\n")
        with Server(args.bin_dir, model, extra) as server:
            cases = record(server)
        entry: dict[str, Any] = {"model": model.name}
        if tpl is not None:
            entry["chat_template_file"] = GEMMA_IT_TEMPLATE
            entry["chat_template_sha256"] = hashlib.sha256(tpl.encode()).hexdigest()
        entry["cases"] = cases
        out["configs"][name] = entry
    args.out.write_text(dump(out), encoding="utf-8")
    sys.stderr.write(f"record_chat_fixtures: wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
