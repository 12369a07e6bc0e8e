"""``prepare_text``: a folder of text files tokenised once into a token folder (``hetcc.train.tokens``),
byte-level by default or with a ``transformers`` tokenizer already on this machine (nothing is
downloaded); the last ``val_fraction`` of the stream, cut at a document boundary, is the ``val`` split."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetcc.errors import HetccError
from hetcc.hardware.schema import Count, Where
from hetcc.train.tokens import DTYPES, TokenFolder, read_token_folder

_SNIFF_BYTES = 8192  # how much of a file too large for max_bytes is read to tell binary from text


@dataclass(frozen=True)
class _Encoder:
    """A tokenizer as ``prepare_text`` uses it: its name in meta.json, vocabulary and one document's ids
    (with the separator after it, if any)."""

    name: str
    vocab_size: int
    encode: Callable[[str], np.ndarray]


_BYTES = _Encoder("bytes", 256, lambda text: np.frombuffer(text.encode("utf-8"), np.uint8))


def prepare_text(
    folder: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | None = None,
    pattern: str = "**/*",
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    overwrite: bool = False,
) -> TokenFolder:
    """Tokenise every text file under ``folder`` into the token folder ``out`` (module docstring).

    Files matching ``pattern`` are read in sorted relative-path order; hidden folders, ``__pycache__``,
    ``out`` itself and files that are not UTF-8 text (a NUL byte, or invalid UTF-8) are skipped.
    ``max_bytes`` stops before the first text file that would take the total past it. ``tokenizer``:
    None for bytes (vocabulary 256), else a ``transformers`` tokenizer name or folder already on this
    machine, whose eos token (if it has one) ends every document. The last ``val_fraction`` of the
    tokens is the validation split, cut at the nearest document boundary when there are several
    documents. ``out`` must be new or empty, or hold an earlier token folder and ``overwrite`` be set:
    nothing else is replaced. Returns what meta.json says.
    """
    source, out = Path(folder), Path(out)
    _check_options(val_fraction, max_bytes)
    _check_source(source)
    _check_out(out, overwrite)
    paths = _candidate_files(source, pattern, out)
    encoder = _encoder(tokenizer)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HetccError(f"{out}: cannot create the folder: {error.strerror or error}") from None
    try:
        return _write_folder(source, out, _documents(paths, max_bytes), encoder, val_fraction, pattern)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()
        raise


def _check_options(val_fraction: object, max_bytes: object) -> None:
    number = isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
    if not (number and 0 <= val_fraction < 1):
        raise HetccError(f"val_fraction: expected a number in [0, 1); got {val_fraction!r}")
    if max_bytes is not None:
        Count()(max_bytes, Where("prepare_text", "max_bytes", HetccError))


def _check_source(source: Path) -> None:
    if not source.exists():
        raise HetccError(f"{source}: the text folder does not exist", hint="give a folder of text files")
    if not source.is_dir():
        raise HetccError(f"{source}: not a folder", hint="give the folder that holds the text files")


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, or holds anything but an earlier token folder (then ``overwrite``
    decides)."""
    if out.exists() and not out.is_dir():
        raise HetccError(f"{out}: a file, not a folder", hint="give a new or empty folder to write tokens to")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        read_token_folder(out)
    except HetccError:
        raise HetccError(
            f"{out}: the folder is not empty and holds no earlier token folder; nothing in it is replaced",
            hint="give a new or empty folder to write tokens to",
        ) from None
    if not overwrite:
        raise HetccError(
            f"{out}: already holds tokens (meta.json); not replaced",
            hint="pass overwrite=True (--force on the command line) to replace them",
        )


def _candidate_files(source: Path, pattern: str, out: Path) -> list[Path]:
    """The files ``pattern`` matches under ``source`` in sorted relative-path order, leaving out hidden
    folders, ``__pycache__`` and ``out`` (a previous run's files are no text to learn from)."""
    if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise HetccError(f"pattern {pattern!r}: not a glob inside the folder", hint='e.g. "**/*.txt"')
    written = out.resolve()
    kept = []
    for path in source.glob(pattern):
        folders = path.relative_to(source).parts[:-1]
        if any(part.startswith(".") or part == "__pycache__" for part in folders):
            continue
        if path.is_file() and written not in path.resolve().parents:
            kept.append(path)
    return sorted(kept, key=lambda path: path.relative_to(source).as_posix())


def _documents(paths: Iterable[Path], max_bytes: int | None) -> Iterator[str]:
    """The text of each file that is text, until the next one would take the total past ``max_bytes``."""
    left = max_bytes
    for path in paths:
        size = _file_size(path)
        if left is not None and size > left:
            if _read_bytes(path, _SNIFF_BYTES).find(b"\0") >= 0:
                continue  # binary: it would be skipped anyway
            if left == max_bytes:
                raise HetccError(
                    f"{path}: {size} bytes, more than max_bytes={max_bytes}; no text file fits",
                    hint="raise max_bytes (--max-bytes)",
                )
            return
        text = _text(_read_bytes(path))
        if text is not None:
            yield text
            left = None if left is None else left - size


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as error:
        raise HetccError(f"{path}: cannot read it: {error.strerror or error}") from None


def _read_bytes(path: Path, limit: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as error:
        raise HetccError(
            f"{path}: cannot read it: {error.strerror or error}", hint="leave it out with --pattern"
        ) from None


def _text(raw: bytes) -> str | None:
    """``raw`` as UTF-8 text, or None for binary data (a NUL byte, or not UTF-8)."""
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _encoder(tokenizer: str | None) -> _Encoder:
    """Bytes, or the named transformers tokenizer from this machine (eos after each document)."""
    if tokenizer is None or tokenizer == _BYTES.name:
        return _BYTES
    hf = _load_tokenizer(tokenizer)
    hf.model_max_length = sys.maxsize  # whole files are encoded: no "longer than the model" warnings
    vocab_size, eos = len(hf), hf.eos_token_id

    def encode(text: str) -> np.ndarray:
        ids = np.asarray(hf.encode(text, add_special_tokens=False) + ([] if eos is None else [eos]), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise HetccError(f"tokenizer {tokenizer!r} gave an id outside its vocabulary of {vocab_size}")
        return ids

    return _Encoder(tokenizer, vocab_size, encode)


def _load_tokenizer(name: str):
    hint = (
        "hetcc downloads nothing: save the tokenizer on this machine first (e.g. "
        "AutoTokenizer.from_pretrained(NAME).save_pretrained(FOLDER)) and give its folder or cached name, "
        "or leave the tokenizer unset for byte-level tokens"
    )
    try:
        from huggingface_hub import constants
        from transformers import AutoTokenizer
    except ImportError:
        raise HetccError(
            f"tokenizer {name!r}: the transformers package is not installed", hint=hint
        ) from None
    offline = constants.HF_HUB_OFFLINE
    # local_files_only alone still lets huggingface_hub call the Hub for its own data (a registry it
    # builds request headers from); its offline switch (what HF_HUB_OFFLINE=1 sets) stops every request.
    constants.HF_HUB_OFFLINE = True
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:200]
        raise HetccError(f"tokenizer {name!r} is not installed locally ({reason})", hint=hint) from None
    finally:
        constants.HF_HUB_OFFLINE = offline


def _write_folder(
    source: Path, out: Path, documents: Iterator[str], encoder: _Encoder, val_fraction: float, pattern: str
) -> TokenFolder:
    """Stream every document's tokens into train.bin, move the last ``val_fraction`` into val.bin, and
    write meta.json last; each under a temporary name first, renamed when complete."""
    dtype = "uint16" if encoder.vocab_size <= 2**16 else "uint32"
    temporary = {name: out / f".{name}.tmp-{os.getpid()}" for name in ("train.bin", "val.bin", "meta.json")}
    try:
        ends = _write_stream(documents, encoder, temporary["train.bin"], DTYPES[dtype])
        if not ends or not ends[-1]:
            raise HetccError(
                f"{source}: no text {'files' if not ends else 'in the files'} matching {pattern!r}",
                hint="hidden folders, __pycache__ and files with NUL bytes or invalid UTF-8 are skipped",
            )
        start = _val_start(ends, val_fraction)
        _split_off(temporary["train.bin"], temporary["val.bin"], start * DTYPES[dtype].itemsize)
        result = TokenFolder(out, dtype, encoder.vocab_size, encoder.name, len(ends), start,
                             ends[-1] - start, str(source.resolve()))  # fmt: skip
        temporary["meta.json"].write_text(result.to_json())
        for name, path in temporary.items():  # meta.json last
            os.replace(path, out / name)
        return result
    finally:
        for path in temporary.values():
            path.unlink(missing_ok=True)


def _write_stream(documents: Iterable[str], encoder: _Encoder, path: Path, dtype: np.dtype) -> list[int]:
    """Write each document's tokens to ``path``; the token count after each document."""
    ends, total = [], 0
    with open(path, "wb") as f:
        for text in documents:
            ids = encoder.encode(text).astype(dtype)
            f.write(ids.tobytes())
            total += ids.size
            ends.append(total)
    return ends


def _val_start(ends: Sequence[int], val_fraction: float) -> int:
    """The first validation token: ``val_fraction`` of the stream from the end, moved to the nearest
    document boundary when there are several documents (never the very start: training keeps some)."""
    total = ends[-1]
    wanted = total - (max(1, round(total * val_fraction)) if val_fraction > 0 else 0)
    boundaries = [end for end in ends[:-1] if 0 < end < total]
    if val_fraction == 0 or not boundaries:
        return wanted
    return min(boundaries, key=lambda end: abs(end - wanted))


def _split_off(train: Path, val: Path, start_bytes: int) -> None:
    """Move ``train``'s bytes from ``start_bytes`` on into ``val``, and sync both to disk."""
    with open(train, "r+b") as stream, open(val, "wb") as tail:
        stream.seek(start_bytes)
        shutil.copyfileobj(stream, tail)
        stream.truncate(start_bytes)
        for f in (stream, tail):
            f.flush()
            os.fsync(f.fileno())
