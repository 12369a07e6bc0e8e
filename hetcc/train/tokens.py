"""hetcc's on-disk token dataset: a folder of text files tokenised once into flat arrays of token ids
(nanoGPT's format), then read as fixed-length windows through ``numpy.memmap``.

A token folder holds::

    <out>/train.bin    every token id of the training split, little-endian uint16 (uint32 when the
                       vocabulary does not fit), documents one after another in sorted path order
    <out>/val.bin      the last ``val_fraction`` of the same stream, cut at a document boundary
    <out>/meta.json    {"format": "hetcc-tokens", "version": 1, "dtype", "vocab_size", "tokenizer",
                        "files", "tokens": {"train", "val"}, "source"}; ``TokenFolder`` is its record

``hetcc.train.text.prepare_text`` writes one (byte-level tokens by default, or a ``transformers`` tokenizer already on this
machine: hetcc downloads nothing); ``TokenDataset`` reads one as ``{"input_ids", "labels"}`` windows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetcc.errors import HetccError, PlanFormatError
from hetcc.hardware.schema import Choice, Count, Nullable, Record, Text, Where, load_file

FORMAT = "hetcc-tokens"
VERSION = 1
SPLITS = ("train", "val")
LABELS = ("inputs", "next")  # or None: no labels
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

_META = Record(
    {"format": Choice((FORMAT,), "format"), "version": Count(maximum=VERSION),
     "dtype": Choice(tuple(DTYPES), "token dtype"), "vocab_size": Count(maximum=2**32),
     "tokenizer": Text(), "files": Count(),
     "tokens": Record({"train": Count(minimum=0), "val": Count(minimum=0)}, required=SPLITS),
     "source": Text()},
    required=("format", "version", "dtype", "vocab_size", "tokenizer", "files", "tokens", "source"),
    missing_hint="prepare the folder again with `hetcc prepare-text SRC OUT --force`",
)  # fmt: skip


@dataclass(frozen=True)
class TokenFolder:
    """A token folder's ``meta.json``: what ``prepare_text`` wrote and ``TokenDataset`` reads."""

    folder: Path
    dtype: str  # "uint16" or "uint32", little-endian
    vocab_size: int
    tokenizer: str  # "bytes", or the transformers tokenizer's name
    files: int  # text files tokenised
    train_tokens: int
    val_tokens: int
    source: str  # the folder the text came from

    @property
    def meta_path(self) -> Path:
        return self.folder / "meta.json"

    def path(self, split: str) -> Path:
        """``<folder>/<split>.bin``."""
        return self.folder / f"{split}.bin"

    def tokens(self, split: str) -> int:
        return self.train_tokens if split == "train" else self.val_tokens

    def describe(self) -> str:
        """One line: files, tokens per split, vocabulary and where they are."""
        return (
            f"{self.files} files from {self.source}: {self.train_tokens:,} train + {self.val_tokens:,} val "
            f"tokens ({self.tokenizer}, vocabulary {self.vocab_size:,}, {self.dtype}) "
            f"in {self.folder}/ (train.bin, val.bin, meta.json)"
        )

    def to_json(self) -> str:
        return json.dumps(
            {"format": FORMAT, "version": VERSION, "dtype": self.dtype, "vocab_size": self.vocab_size,
             "tokenizer": self.tokenizer, "files": self.files,
             "tokens": {"train": self.train_tokens, "val": self.val_tokens}, "source": self.source},
            indent=2,
        )  # fmt: skip


def read_token_folder(folder: str | os.PathLike) -> TokenFolder:
    """``folder/meta.json`` checked field by field (PlanFormatError naming the file and field)."""
    path = Path(folder) / "meta.json"
    if not path.is_file():
        raise PlanFormatError(
            f"{folder}: no meta.json; not a token folder",
            hint="write one with `hetcc prepare-text SRC OUT` (hetcc.train.text.prepare_text)",
        )
    data = load_file(path, "token metadata", error=PlanFormatError, suffixes=(".json",))
    meta = _META(data, Where(str(path), error=PlanFormatError))
    if meta["vocab_size"] > np.iinfo(DTYPES[meta["dtype"]]).max + 1:
        Where(str(path), error=PlanFormatError).at("vocab_size").fail(
            f"{meta['vocab_size']} token ids do not fit in {meta['dtype']}"
        )
    return TokenFolder(
        Path(folder), meta["dtype"], meta["vocab_size"], meta["tokenizer"], meta["files"],
        meta["tokens"]["train"], meta["tokens"]["val"], meta["source"],
    )  # fmt: skip


class TokenDataset(torch.utils.data.Dataset):
    """Fixed-length windows of a token folder's split, read through ``numpy.memmap``.

    Window ``i`` covers tokens ``[i * seq_len, i * seq_len + seq_len + 1)``, so there are
    ``(tokens - 1) // seq_len``. An item is ``{"input_ids", "labels"}`` (LongTensors of ``seq_len``):
    ``labels="inputs"`` repeats the inputs (models that shift labels themselves, like transformers'
    ``*ForCausalLM``), ``"next"`` gives the tokens one ahead (nanoGPT's targets, for a loss on logits),
    None leaves labels out. Items come in order; a sampler shuffles. Pickles without its array (spawned
    ranks, DataLoader workers) and maps the file again where it is unpickled.
    """

    def __init__(
        self, folder: str | os.PathLike, seq_len: int, split: str = "train", labels: str | None = "inputs"
    ):
        where = Where("TokenDataset", error=HetccError)
        self._seq_len = Count()(seq_len, where.at("seq_len"))
        self._split = Choice(SPLITS, "split")(split, where.at("split"))
        self._labels = Nullable(Choice(LABELS, "labels mode"))(labels, where.at("labels"))
        self._meta = read_token_folder(folder)
        self._length = (self.tokens - 1) // self._seq_len
        if self._length < 1:
            raise HetccError(
                f"{self._meta.path(split)}: {self.tokens} tokens, fewer than one window of seq_len + 1 = "
                f"{self._seq_len + 1}",
                hint="use a smaller seq_len, more text, or (for val) a larger val_fraction",
            )
        self._windows = self._open()

    @property
    def vocab_size(self) -> int:
        return self._meta.vocab_size

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def tokens(self) -> int:
        """Tokens in this split."""
        return self._meta.tokens(self._split)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: rows[0] for key, rows in self.rows([index]).items()}

    def rows(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """Many windows in one read: each value is ``[len(indices), seq_len]``, the items stacked."""
        index = np.asarray(indices).reshape(-1)
        if index.size == 0:
            index = index.astype(np.int64)
        if index.dtype.kind not in "iu":
            raise TypeError(f"window indices must be integers; got {index.dtype}")
        bad = index[(index < -self._length) | (index >= self._length)]
        if bad.size:
            raise IndexError(f"window {bad[0]} out of range for {self._length} windows")
        if self._windows is None:
            self._windows = self._open()
        tokens = torch.from_numpy(self._windows[index].astype(np.int64))
        batch = {"input_ids": tokens[:, :-1].contiguous()}
        if self._labels is not None:  # a copy of its own: masking labels in place leaves the inputs be
            labels = tokens[:, :-1] if self._labels == "inputs" else tokens[:, 1:]
            batch["labels"] = labels.clone(memory_format=torch.contiguous_format)
        return batch

    def _open(self) -> np.ndarray:
        """The split's windows as a view of its memmap, after checking the file is as long as meta.json
        says."""
        path, dtype = self._meta.path(self._split), DTYPES[self._meta.dtype]
        expected = self.tokens * dtype.itemsize
        try:
            size = path.stat().st_size
        except OSError as error:
            raise PlanFormatError(f"{path}: cannot read it: {error.strerror or error}") from None
        if size != expected:
            raise PlanFormatError(
                f"{path}: {size} bytes, but meta.json says {self.tokens} {self._meta.dtype} tokens "
                f"({expected} bytes): truncated or from another preparation",
                hint="prepare the folder again with `hetcc prepare-text SRC OUT --force`",
            )
        data = np.memmap(path, dtype=dtype, mode="r", shape=(self.tokens,))
        return np.lib.stride_tricks.sliding_window_view(data, self._seq_len + 1)[:: self._seq_len]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_windows": None}  # reopened on first use, not pickled as an array
