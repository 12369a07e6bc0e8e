"""The token dataset: ``prepare_text`` writes train.bin/val.bin/meta.json from a folder of text files,
``TokenDataset`` reads them back as windows, and every bad input is a HetccError naming what is at fault."""

from __future__ import annotations

import json
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from hetcc.cli import main
from hetcc.errors import HetccError
from hetcc.train.text import prepare_text
from hetcc.train.tokens import TokenDataset, read_token_folder

TEXTS = {
    "a.txt": "hello world\n",
    "Z.txt": "upper case sorts first\n",
    "sub/b.md": "naïve café, 東京\n",
    "sub/deeper/c.txt": "third document\n",
}


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder of text files, with a binary file, a non-UTF-8 file, a hidden folder and __pycache__."""
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "image.bin").write_bytes(b"GIF89a\0\0\x01")
    (root / "latin1.txt").write_bytes("d\xe9j\xe0 vu\n".encode("latin-1"))
    for skipped in (".git/config", "__pycache__/a.txt", "sub/.cache/x.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("must not be read\n")
    return root


def _stream(out: Path) -> bytes:
    """train.bin then val.bin, back to bytes (byte-level tokens)."""
    meta = read_token_folder(out)
    ids = [np.fromfile(meta.path(split), dtype="<u2") for split in ("train", "val")]
    return np.concatenate(ids).astype(np.uint8).tobytes()


def test_byte_tokens_round_trip_the_text_files_in_path_order(corpus, tmp_path):
    summary = prepare_text(corpus, tmp_path / "out", val_fraction=0.3)
    expected = "".join(TEXTS[name] for name in sorted(TEXTS)).encode("utf-8")
    assert _stream(tmp_path / "out") == expected
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta == {
        "format": "hetcc-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes",
        "files": 4, "tokens": {"train": summary.train_tokens, "val": summary.val_tokens},
        "source": str(corpus.resolve()),
    }  # fmt: skip
    assert summary.train_tokens + summary.val_tokens == len(expected) and summary.files == 4
    last = TEXTS[sorted(TEXTS)[-1]].encode("utf-8")
    assert summary.val_tokens == len(last)  # the boundary nearest 30% from the end: the last document
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_the_standard_librarys_source_splits_at_the_document_boundary_nearest_val_fraction(tmp_path):
    source, max_bytes, fraction = Path(json.__file__).parent, 45_000, 0.1
    files = sorted((p for p in source.glob("*.py")), key=lambda p: p.name)
    sizes = np.cumsum([p.stat().st_size for p in files])
    kept = files[: int(np.searchsorted(sizes, max_bytes, side="right"))]
    ends = [int(end) for end in sizes[: len(kept)]]
    summary = prepare_text(source, tmp_path / "out", val_fraction=fraction, max_bytes=max_bytes)
    assert summary.files == len(kept) >= 3 and summary.train_tokens + summary.val_tokens == ends[-1]
    assert _stream(tmp_path / "out") == b"".join(p.read_bytes() for p in kept)
    start, wanted = summary.train_tokens, ends[-1] * (1 - fraction)
    assert start in ends[:-1]
    assert all(abs(start - wanted) <= abs(end - wanted) for end in ends[:-1])
    dataset = TokenDataset(tmp_path / "out", seq_len=64)
    assert len(pickle.dumps(dataset)) < 2000 < dataset.tokens  # the array is not pickled


@pytest.fixture
def stream(tmp_path) -> Path:
    """A token folder whose train split is the ten byte tokens of "abcdefghij"."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.txt").write_text("abcdefghij")
    prepare_text(tmp_path / "src", tmp_path / "tokens", val_fraction=0)
    return tmp_path / "tokens"


def _text(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode()


@pytest.mark.parametrize(
    ("labels", "expected"), [("inputs", ["abc", "def", "ghi"]), ("next", ["bcd", "efg", "hij"]), (None, None)]
)
def test_windows_and_their_labels(stream, labels, expected):
    dataset = TokenDataset(stream, seq_len=3, labels=labels)
    assert (len(dataset), dataset.tokens, dataset.seq_len, dataset.vocab_size) == (3, 10, 3, 256)
    items = [dataset[i] for i in range(len(dataset))]
    assert [_text(item["input_ids"]) for item in items] == ["abc", "def", "ghi"]
    assert all(item["input_ids"].dtype == torch.long and item["input_ids"].shape == (3,) for item in items)
    if labels is None:
        assert all(set(item) == {"input_ids"} for item in items)
    else:
        assert [_text(item["labels"]) for item in items] == expected
    rows = dataset.rows([2, 0, 1, 2])
    for key, value in rows.items():
        assert torch.equal(value, torch.stack([dataset[i][key] for i in (2, 0, 1, 2)]))
    assert torch.equal(dataset[-1]["input_ids"], dataset[2]["input_ids"])


def test_labels_are_a_copy_of_their_own(stream):
    item = TokenDataset(stream, seq_len=3)[0]
    item["labels"][0] = -100
    assert _text(item["input_ids"]) == "abc"


@pytest.mark.parametrize("seq_len", range(1, 10))
def test_window_count_is_tokens_minus_one_over_seq_len(stream, seq_len):
    assert len(TokenDataset(stream, seq_len=seq_len)) == 9 // seq_len


def test_out_of_range_windows_are_index_errors(stream):
    dataset = TokenDataset(stream, seq_len=3)
    with pytest.raises(IndexError):
        dataset[3]
    with pytest.raises(IndexError):
        dataset.rows([0, -4])
    assert dataset.rows([])["input_ids"].shape == (0, 3)


def test_a_dataset_pickles_and_feeds_a_dataloader(stream):
    dataset = TokenDataset(stream, seq_len=2, labels="next")
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(copy) == len(dataset) and torch.equal(copy[3]["labels"], dataset[3]["labels"])
    batches = list(torch.utils.data.DataLoader(copy, batch_size=2, num_workers=0))
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (2, 2)
    assert torch.equal(batches[1]["labels"], dataset.rows([2, 3])["labels"])


# ---- errors ----------------------------------------------------------------------------------------
def test_a_missing_folder_or_one_without_text_is_refused(tmp_path):
    with pytest.raises(HetccError, match="nowhere: the text folder does not exist"):
        prepare_text(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(HetccError, match=r"binary: no text files"):
        prepare_text(tmp_path / "binary", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_out_folder_with_the_users_files_is_left_as_it_was(corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "train.bin").write_bytes(b"my own file")
    with pytest.raises(HetccError, match="mine: the folder is not empty"):
        prepare_text(corpus, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "train.bin"]
    assert (out / "notes.txt").read_text() == "keep me" and (out / "train.bin").read_bytes() == b"my own file"


def test_an_earlier_token_folder_is_replaced_only_with_overwrite(corpus, tmp_path):
    out = tmp_path / "out"
    prepare_text(corpus, out, val_fraction=0.3)
    with pytest.raises(HetccError, match="already holds tokens") as error:
        prepare_text(corpus, out, val_fraction=0)
    assert "overwrite=True" in str(error.value)
    summary = prepare_text(corpus, out, val_fraction=0, overwrite=True)
    assert summary.val_tokens == 0 and read_token_folder(out) == summary
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda meta: "{not json", r"meta.json: invalid JSON"),
        (lambda meta: {**meta, "format": "nanogpt"}, r"meta.json: format: unknown format 'nanogpt'"),
        (lambda meta: {**meta, "tokens": {"train": -5, "val": 0}}, r"meta.json: tokens.train: expected an"),
        (lambda meta: {k: v for k, v in meta.items() if k != "dtype"}, r"missing required key 'dtype'"),
    ],
)
def test_a_corrupted_meta_json_names_the_file_and_field(stream, change, message):
    meta = json.loads((stream / "meta.json").read_text())
    changed = change(meta)
    (stream / "meta.json").write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(HetccError, match=message):
        TokenDataset(stream, seq_len=3)


def test_a_truncated_bin_file_is_named(stream):
    path = stream / "train.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(HetccError, match=r"train.bin: 18 bytes, but meta.json says 10 uint16 tokens"):
        TokenDataset(stream, seq_len=3)


def test_a_split_shorter_than_one_window_says_how_long_it_is(stream):
    with pytest.raises(HetccError, match=r"train.bin: 10 tokens, fewer than one window of seq_len \+ 1 = 11"):
        TokenDataset(stream, seq_len=10)
    with pytest.raises(HetccError, match=r"val.bin: 0 tokens"):
        TokenDataset(stream, seq_len=3, split="val")
    with pytest.raises(HetccError, match=r"TokenDataset: split: unknown split 'test'"):
        TokenDataset(stream, seq_len=3, split="test")


def test_an_unknown_tokenizer_is_an_error_and_nothing_is_downloaded(corpus, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    name = "hetcc-test/no-such-tokenizer"
    with pytest.raises(HetccError, match=f"tokenizer '{name}' is not installed") as error:
        prepare_text(corpus, tmp_path / "out", tokenizer=name)
    assert "hetcc downloads nothing" in str(error.value)
    assert attempts == [] and not (tmp_path / "out").exists()


def test_a_local_transformers_tokenizer_ends_each_document_with_eos(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "1.txt").write_text("hello world")
    (tmp_path / "src" / "2.txt").write_text("world other")
    name = str(tmp_path / "tokenizer")
    summary = prepare_text(tmp_path / "src", tmp_path / "out", tokenizer=name)
    assert (summary.vocab_size, summary.dtype, summary.tokenizer) == (4, "uint16", name)
    ids = np.concatenate([np.fromfile(summary.path(split), dtype="<u2") for split in ("train", "val")])
    assert ids.tolist() == [2, 3, 1, 3, 0, 1] and summary.val_tokens == 3


# ---- the command -----------------------------------------------------------------------------------
def test_the_command_prints_the_summary_and_how_to_read_it(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["prepare-text", str(corpus), str(out), "--val-fraction", "0.3"]) == 0
    printed = capsys.readouterr().out
    assert "4 files from" in printed and "vocabulary 256" in printed and str(out) in printed
    assert f"TokenDataset({json.dumps(str(out))}, seq_len=" in printed
    assert len(TokenDataset(out, seq_len=4)) > 0


def test_the_command_reports_a_bad_folder_in_one_error_line(tmp_path, capsys):
    assert main(["prepare-text", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetcc: error: ") and err.count("hetcc: error:") == 1 and "missing" in err
