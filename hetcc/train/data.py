"""Training data for a pipeline: step k trains global batch k, and each rank reads only its share.

What a user passes as ``data`` (directly, or a module-level factory returning it, which each rank calls):

- a map-style ``torch.utils.data.Dataset`` whose items are dicts of tensors (hetcc's ``TokenDataset``
  too): hetcc draws global batches of ``microbatches x rows`` items, shuffled by ``seed + epoch``,
  dropping the last partial batch, epoch after epoch;
- a ``torch.utils.data.DataLoader`` over a map-style dataset: its own sampler and ``batch_size`` (which
  must be the compiled global batch) give the batches, epoch after epoch; its ``collate_fn`` runs on each
  microbatch's items, in this process (its workers are not used);
- any other iterable of global batches (dicts of tensors shaped like the compiled example batch), such
  as a generator or a DataLoader over an ``IterableDataset``: read once, in order; when it ends before
  the last step, the run stops with a ``DataError`` naming the step.

Each rank reads only what its stage needs: the model inputs its graph reads (token ids on the first
stage, labels on the last) and, on the last stage with a ``loss_fn``, the target; a middle stage reads
nothing. From a dataset or a DataLoader a rank fetches only the items of the microbatches it runs; an
iterable of batches has no random access, so a rank that needs data reads each batch whole and keeps its
share. Every rank sees the same order: whatever the data does with torch's global random generator
(a sampler drawing its seed, a generator shuffling) runs on a generator state of its own, seeded by
``seed`` and the same on every rank, apart from the rank's own (dropout) state.

The data position is the number of global batches consumed (``RankData.position``); it is saved with
every checkpoint, and a resumed run skips that many batches (index lists only, for a dataset or a
DataLoader), so N steps straight equal k steps, a stop and N - k more, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from hetcc.errors import HetccError, did_you_mean

TARGET_KEYS = ("targets", "labels")  # where a loss_fn's target is found in a batch, in this order


class DataError(HetccError):
    """A batch does not fit the compiled pipeline (names the step, the input, what was expected and what
    came), or the data ran out before the last step."""


@dataclass(frozen=True)
class RankInputs:
    """What one rank reads of every global batch, and what the compiled pipeline expects of it."""

    names: tuple[str, ...]  # model inputs this rank's stage reads
    microbatches: int  # M: the global batch is M microbatches of ``rows`` rows
    rows: int
    mine: tuple[int, ...]  # the microbatches this rank runs
    shapes: dict[str, tuple] = field(default_factory=dict)  # traced (microbatch) shape by input
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # traced dtype by input
    model_inputs: tuple[str, ...] = ()  # what any stage reads: every rank checks a batch has all of it
    target: bool = False  # the last stage with a loss_fn: it also reads the target (``TARGET_KEYS``)
    # input -> (rows, name) of the embedding table it indexes (``startup.embedding_tables``)
    tables: dict[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def batch_rows(self) -> int:
        return self.microbatches * self.rows

    @property
    def reads_data(self) -> bool:
        return bool(self.names) or self.target


@dataclass
class RankBatch:
    """This rank's share of one global batch: microbatch -> input name -> tensor, and the targets."""

    step: int
    inputs: dict[int, dict[str, Any]]
    targets: dict[int, Any] | None = None


# ------------------------------------------------------------------------------------ the rank's view


class RankData:
    """This rank's share of global batch after global batch, from ``position`` on (batches consumed)."""

    def __init__(self, data: Any, needs: RankInputs, *, seed: int = 0, position: int = 0):
        self.needs, self.seed, self.position = needs, seed, 0
        self.source = _open(data, needs, seed) if needs.reads_data else None
        if self.source is not None and position:
            self.source.skip(position)
        self.position = position

    def __iter__(self) -> Iterator[RankBatch]:
        return self

    def __next__(self) -> RankBatch:
        step = self.position
        if self.source is None:
            batch = RankBatch(step, {m: {} for m in self.needs.mine})
        else:
            batch = self.source.next(step)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.position, "seed": self.seed}


def share_of(batch: Any, needs: RankInputs, step: int) -> RankBatch:
    """A rank's share of one whole global batch (a dict of tensors), checked: every model input present,
    ``microbatches x rows`` rows, each microbatch shaped and typed as traced."""
    batch = as_named(batch, needs, step)
    _check_keys(batch, needs, step)
    keep = [*needs.names, *([_target_key(batch, needs, step)] if needs.target else [])]
    for name in keep:
        _check_rows(name, batch[name], needs, step)
    chunks = split_microbatches({name: batch[name] for name in keep}, needs.microbatches)
    return _checked(step, {m: chunks[m] for m in needs.mine}, needs, batch)


def split_microbatches(inputs: Mapping[Any, Any], microbatches: int) -> list[dict[Any, Any]]:
    """One step's batch as ``microbatches`` equal chunks of every tensor along dim 0 (clones: a view
    would carry the whole batch's storage); scalars, 0-d tensors and other values go to every chunk."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise HetccError(f"microbatches must be a positive integer, got {microbatches!r}")
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % microbatches:
            raise HetccError(
                f"input {name!r} has {value.shape[0]} rows (shape {tuple(value.shape)}) and does not split "
                f"into {microbatches} equal microbatches along dim 0",
                hint=f"pass a batch whose size is a multiple of {microbatches}, or change microbatches",
            )
    chunks = [dict(inputs) for _ in range(microbatches)]
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            for chunk, part in zip(chunks, value.chunk(microbatches)):
                chunk[name] = part.clone()
    return chunks


def global_batches(data: Any, batch_rows: int, *, seed: int = 0) -> Iterator[dict]:
    """The global batches a pipeline trains on, whole and in its order: what an eager loop in one process
    reads to train on the same data."""
    source = _open(data, RankInputs((), 1, batch_rows, (0,)), seed, whole=True)
    step = 0
    while True:
        try:
            yield source.next(step).inputs[0]
        except DataError as error:
            if isinstance(error.__cause__, StopIteration):
                return
            raise
        step += 1


# ------------------------------------------------------------------------------------ sources


def _open(data: Any, needs: RankInputs, seed: int, whole: bool = False) -> _Source:
    if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
        return _Indexed(data.dataset, needs, _LoaderOrder(data, needs, seed), data.collate_fn, whole)
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset) and hasattr(data, "__len__"):
        return _Indexed(data, needs, _ShuffledOrder(len(data), needs.batch_rows, seed), None, whole)
    if callable(data) and not hasattr(data, "__iter__"):  # a factory: each rank calls it, on the data's state
        return _open(_RandomState(seed).run(data), needs, seed, whole)
    if hasattr(data, "__iter__"):
        return _Stream(data, needs, seed, whole)
    raise HetccError(
        f"data must be a Dataset, a DataLoader, an iterable of batches or a factory returning one, got "
        f"{type(data).__name__}",
        hint="e.g. hetcc.train.TokenDataset('tokens/', seq_len=64), or a function yielding dicts of tensors",
    )


class _Source:
    def next(self, step: int) -> RankBatch: ...

    def skip(self, batches: int) -> None: ...


class _RandomState:
    """A torch global-generator state of the data's own, the same on every rank: code that draws from
    ``torch``'s global generator (a sampler's seed, a shuffling generator) runs on it, and the rank's own
    state (its dropout draws) is restored around it."""

    def __init__(self, seed: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.state = torch.get_rng_state()

    def run(self, function: Callable, *args):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.state)
            try:
                return function(*args)
            finally:
                self.state = torch.get_rng_state()


class _ShuffledOrder:
    """A map-style dataset's global batches: a permutation per epoch from ``seed + epoch``, cut into
    batches of ``batch_rows`` items (the last partial batch dropped)."""

    def __init__(self, items: int, batch_rows: int, seed: int):
        if items < batch_rows:
            raise HetccError(
                f"the dataset has {items} items, fewer than one global batch ({batch_rows})",
                hint="use more data, or compile with a smaller batch",
            )
        self.items, self.batch_rows, self.seed = items, batch_rows, seed
        self.per_epoch = items // batch_rows
        self.epoch, self.permutation = -1, torch.empty(0, dtype=torch.int64)

    def indices(self, batch: int) -> list[int]:
        epoch, index = divmod(batch, self.per_epoch)
        if epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self.epoch, self.permutation = epoch, torch.randperm(self.items, generator=generator)
        return self.permutation[index * self.batch_rows : (index + 1) * self.batch_rows].tolist()


class _LoaderOrder:
    """A DataLoader's own batches of indices (its sampler), epoch after epoch, drawn on the data's random
    state; a resumed run replays them without loading any item."""

    def __init__(self, loader: DataLoader, needs: RankInputs, seed: int):
        if loader.batch_size != needs.batch_rows or loader.batch_sampler is None:
            raise HetccError(
                f"the DataLoader's batch_size is {loader.batch_size}; the pipeline was compiled for global "
                f"batches of {needs.batch_rows} rows ({needs.microbatches} microbatches x {needs.rows})",
                hint=f"build the DataLoader with batch_size={needs.batch_rows} (and drop_last=True)",
            )
        self.sampler, self.random, self.epoch, self.batch = loader.batch_sampler, _RandomState(seed), 0, 0
        self.iterator = self.random.run(lambda: iter(self.sampler))
        if len(self.sampler) == 0:
            raise HetccError("the DataLoader yields no batch", hint="check its dataset and drop_last")

    def indices(self, batch: int) -> list[int]:
        while self.batch <= batch:
            try:
                found = self.random.run(next, self.iterator)
            except StopIteration:
                self._next_epoch()
                continue
            if self.batch == batch:
                self.batch += 1
                return list(found)
            self.batch += 1
        raise AssertionError(f"batch {batch} requested after batch {self.batch - 1}")

    def _next_epoch(self) -> None:
        self.epoch += 1
        set_epoch = getattr(getattr(self.sampler, "sampler", None), "set_epoch", None)
        if set_epoch is not None:  # DistributedSampler and the like reshuffle per epoch this way
            set_epoch(self.epoch)
        self.iterator = self.random.run(lambda: iter(self.sampler))


class _Indexed(_Source):
    """Items by index: a rank fetches only its microbatches' items, only the keys it reads."""

    def __init__(self, dataset, needs: RankInputs, order, collate: Callable | None, whole: bool):
        self.dataset, self.needs, self.order, self.whole = dataset, needs, order, whole
        self.collate = collate or default_collate
        self.batch = 0

    def skip(self, batches: int) -> None:
        for batch in range(self.batch, self.batch + batches):
            self.order.indices(batch)  # index lists only: nothing is loaded
        self.batch += batches

    def next(self, step: int) -> RankBatch:
        indices = self.order.indices(self.batch)
        self.batch += 1
        if self.whole:
            return RankBatch(step, {0: self._fetch(indices, step)})
        rows, mine = self.needs.rows, self.needs.mine
        taken = [i for m in mine for i in indices[m * rows : (m + 1) * rows]]
        fetched = self._fetch(taken, step)  # one fetch and one collate for all this rank's microbatches
        parts = {
            k: v.split(rows) if isinstance(v, torch.Tensor) and v.dim() else None for k, v in fetched.items()
        }
        share = {
            m: {k: (part[j] if part is not None else fetched[k]) for k, part in parts.items()}
            for j, m in enumerate(mine)
        }
        return _checked(step, share, self.needs)

    def _fetch(self, indices: list[int], step: int) -> dict[str, Any]:
        """The items at ``indices`` collated: in one read where the dataset allows it and the collate
        function is torch's default (``rows()`` of hetcc's token dataset, a ``TensorDataset``'s tensors:
        the stack of the items), else torch's batched ``__getitems__`` where the dataset has it, else item
        by item, then the collate function."""
        try:
            if self.collate is default_collate and hasattr(self.dataset, "rows"):
                return dict(self.dataset.rows(indices))
            if self.collate is default_collate and isinstance(self.dataset, TensorDataset):
                rows = torch.as_tensor(indices)
                return as_named([tensor[rows] for tensor in self.dataset.tensors], self.needs, step)
            many = getattr(self.dataset, "__getitems__", None)
            items = many(indices) if many is not None else [self.dataset[i] for i in indices]
            return as_named(self.collate(items), self.needs, step)
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as error:
            raise DataError(
                f"step {step}: fetching items {indices[:4]}{'...' if len(indices) > 4 else ''} failed: "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                hint="each item must be a dict (or tuple) of tensors of one shape (what collate stacks)",
            ) from error


class _Stream(_Source):
    """An iterable of global batches, read once in order; a rank keeps its share of each."""

    def __init__(self, data, needs: RankInputs, seed: int, whole: bool):
        self.needs, self.whole, self.random = needs, whole, _RandomState(seed)
        self.iterator = self.random.run(iter, data)
        self.batch = 0

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            self._take(self.batch)

    def next(self, step: int) -> RankBatch:
        batch = as_named(self._take(step), self.needs, step)
        return RankBatch(step, {0: batch}) if self.whole else share_of(batch, self.needs, step)

    def _take(self, step: int):
        try:
            batch = self.random.run(next, self.iterator)
        except StopIteration as end:
            raise DataError(
                f"step {step}: the data ran out after {self.batch} batches",
                hint="give at least as many batches as steps (the last completed step's checkpoint is "
                "kept), or pass a Dataset or DataLoader, which hetcc reads epoch after epoch",
            ) from end
        self.batch += 1
        return batch


# ------------------------------------------------------------------------------------ checks


def as_named(batch: Any, needs: RankInputs, step: int) -> dict[str, Any]:
    """A batch as a dict: a tuple or list (a ``TensorDataset``'s items) is the model inputs in order,
    then the loss function's target."""
    if isinstance(batch, Mapping):
        return dict(batch)
    names = (*needs.model_inputs, TARGET_KEYS[0])
    if isinstance(batch, (tuple, list)) and needs.model_inputs and len(batch) in (len(names) - 1, len(names)):
        return dict(zip(names, batch))
    raise DataError(
        f"step {step}: a batch must be a dict of input name -> tensor, got {type(batch).__name__}"
        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""),
        hint=f"yield dicts keyed by the model's inputs {list(needs.model_inputs)} (and 'targets' for a "
        "loss_fn), or tuples in that order",
    )


def _checked(
    step: int, inputs: dict[int, dict], needs: RankInputs, whole: Mapping | None = None
) -> RankBatch:
    """Check the microbatches a rank took against the traced shapes and dtypes; split off the target."""
    targets = {} if needs.target else None
    for m, chunk in inputs.items():
        if whole is None:
            _check_keys(chunk, needs, step)
        for name in needs.names:
            _check_tensor(name, chunk[name], needs, step, m)
        if targets is not None:
            key = _target_key(chunk, needs, step)
            targets[m] = chunk[key]
        inputs[m] = {name: chunk[name] for name in needs.names}
    return RankBatch(step, inputs, targets)


def _check_keys(batch: Mapping, needs: RankInputs, step: int) -> None:
    """Every model input is in the batch; every rank checks all of them, so all stop at the same step."""
    for name in (*needs.model_inputs, *needs.names):
        if name not in batch:
            raise DataError(
                f"step {step}: the batch has no input {name!r} (it has {sorted(map(str, batch))})",
                hint=f"the compiled model reads {list(needs.model_inputs or needs.names)}"
                + did_you_mean(name, map(str, batch)),
            )


def _target_key(batch: Mapping, needs: RankInputs, step: int) -> str:
    for key in TARGET_KEYS:
        if key in batch and key not in needs.model_inputs:
            return key
    raise DataError(
        f"step {step}: the batch has no target for the loss function (it has {sorted(map(str, batch))})",
        hint=f"add the target under {TARGET_KEYS[0]!r} (or {TARGET_KEYS[1]!r} when the model takes no labels)",
    )


def _check_rows(name: str, value: Any, needs: RankInputs, step: int) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return
    if value.shape[0] != needs.batch_rows:
        raise DataError(
            f"step {step}: input {name!r} has {value.shape[0]} rows (shape {tuple(value.shape)}); the pipeline "
            f"takes global batches of {needs.batch_rows} rows ({needs.microbatches} microbatches x {needs.rows})",
            hint=f"give batches of exactly {needs.batch_rows} rows (drop_last=True drops a short last batch)",
        )


def _check_tensor(name: str, value: Any, needs: RankInputs, step: int, microbatch: int) -> None:
    shape, dtype = needs.shapes.get(name), needs.dtypes.get(name)
    where = f"step {step}: input {name!r} (microbatch {microbatch})"
    if not isinstance(value, torch.Tensor):
        if shape is not None:
            raise DataError(f"{where} is a {type(value).__name__}; expected a tensor of shape {shape}")
        return
    if shape is not None and not _fits(shape, tuple(value.shape)):
        raise DataError(
            f"{where} has shape {tuple(value.shape)}; the pipeline was compiled for {tuple(shape)}",
            hint="give batches shaped like the compiled example batch (compile again for other shapes)",
        )
    if dtype is not None and value.dtype != dtype:
        raise DataError(
            f"{where} has dtype {value.dtype}; the pipeline was compiled for {dtype}",
            hint=f"convert it (e.g. .to({dtype})) in the dataset or collate_fn",
        )
    if name in needs.tables and value.numel():
        rows, table = needs.tables[name]
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= rows:
            raise DataError(
                f"{where} holds token id {high if high >= rows else low}; the model's embedding {table!r} has "
                f"{rows} rows (ids 0..{rows - 1})",
                hint="use data tokenised for this model's vocabulary (a token folder's meta.json gives its "
                "vocab_size; `hetcc prepare-text --tokenizer` takes the model's tokenizer), or a model with more",
            )


def _fits(traced: tuple, shape: tuple) -> bool:
    """A shape matches the traced one (a symbolic dimension, saved as its name, matches any size)."""
    return len(traced) == len(shape) and all(not isinstance(t, int) or t == s for t, s in zip(traced, shape))
