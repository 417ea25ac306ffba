"""The soak's short variant (issue 20): scripts/soak.py for two minutes, 32 clients, against a
``kvserve serve`` it starts (the long run is the same script for 30 minutes; RELIABILITY.md).
Its oracles are its own: every malformed request a 4xx with a JSON error, every stream not
abandoned ending with [DONE], no 5xx or dropped connection, RSS flat over the second half,
the K/V back to baseline, and a greedy probe byte-identical at the start and the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_two_minute_soak(model_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--duration", "120"]
    cmd += ["--clients", "32", "--model", str(model_path), "--threads", "2"]
    cmd += ["--kv-memory", "64MiB", "--port", "8097", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip(), out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["unexpected"] == [], report["unexpected"][:5]
    kinds = report["requests"]
    assert set(kinds) == {"stream", "abandoned", "session", "sampled", "malformed"}, kinds
    assert min(kinds.values()) >= 20, kinds
    assert report["probe_same"] and report["kv_baseline"], report
    assert report["rss_growth_after_warmup_mb"] <= 32, report
    assert report["passed"] and out.returncode == 0, report
