"""The HTTP API fuzzed by schemathesis against the server's own OpenAPI schema, short run
(issue 20; the long run is the same script, RELIABILITY.md): valid and schema-breaking cases
for every operation; no 5xx, no dropped connection, every 4xx a JSON error body, the server
alive at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_schemathesis_finds_no_5xx(model_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "fuzz_http.py"), "--examples", "15"]
    cmd += ["--model", str(model_path), "--threads", "2", "--port", "8098", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip(), out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], report["failures"][:5]
    assert report["operations"] == 16 and report["cases"] >= 16 * 15, report
    assert report["alive"] and report["passed"] and out.returncode == 0, report


def test_the_openapi_document_describes_every_body() -> None:
    from kvserve.server import ServerConfig, create_app

    doc = create_app(ServerConfig(api_key="k")).app.openapi()  # type: ignore[attr-defined]
    posts = {p: item["post"] for p, item in doc["paths"].items() if "post" in item}
    assert all("requestBody" in op for p, op in posts.items() if not p.endswith("/save")), posts
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert "messages" in chat["required"]
    assert doc["security"] == [{"bearer": []}]
