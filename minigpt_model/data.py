"""Token data: documents -> one packed stream -> (seq_len + 1)-token windows -> deterministic batches.

Packing wastes nothing on padding: documents are joined with the end-of-text token and cut into
consecutive windows; a window's last token is the next window's first input, so inputs and
targets (shifted by one) cover the stream once. The held-out split is by document.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from minigpt_model.corpus import default_corpus
from minigpt_model.tokenizer import END_OF_TEXT


class DataError(Exception):
    """The training data cannot be used (message says why)."""


# The data is read into memory and tokenized in Python: beyond this, pre-tokenize it instead.
MAX_DATA_BYTES = 1 << 30


def read_documents(paths: list[str] | None, *, separator: str = END_OF_TEXT, seed: int = 0) -> list[str]:
    """Documents from text files split on `separator`, or the built-in stories when `paths` is empty."""
    if not paths:
        text = default_corpus(seed=seed)
    else:
        from shardplan.terminal import FileTooLarge, read_bounded

        parts = []
        for path in paths:
            try:
                parts.append(read_bounded(Path(path), MAX_DATA_BYTES).decode("utf-8"))
            except FileNotFoundError:
                raise DataError(f"data file {path} does not exist") from None
            except (OSError, UnicodeDecodeError, FileTooLarge) as exc:
                raise DataError(f"cannot read data file {path}: {exc}") from None
        text = separator.join(parts)
    documents = [doc.strip() for doc in text.split(separator) if doc.strip()]
    if not documents:
        raise DataError(f"no text in {', '.join(paths)}: the data files are empty")
    return documents


def pack(documents: list[str], tokenizer) -> np.ndarray:
    """One int32 stream: each document's tokens followed by end-of-text."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eot)
    return np.asarray(ids, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Windows:
    """Consecutive (seq_len + 1)-token windows of a packed stream."""

    stream: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def take(self, indices: np.ndarray) -> np.ndarray:
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        return self.stream[starts + np.arange(self.seq_len + 1)]  # (B, T+1)


@dataclasses.dataclass(frozen=True)
class Dataset:
    train: Windows
    valid: Windows
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train) // self.batch_size

    def batch(self, step: int, *, process: int = 0, processes: int = 1) -> np.ndarray:
        """Rows of global batch `step` that belong to `process` (B / processes of them), (B/P, T+1).

        Each epoch is a fresh permutation seeded by (seed, epoch): the batch at a step depends
        on nothing but the step, so a resumed run sees exactly the batches it would have seen.
        """
        epoch, index = divmod(step, self.steps_per_epoch)
        order = _epoch_order(self.seed, epoch, len(self.train))
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        share = self.batch_size // processes
        return self.train.take(rows[process * share : (process + 1) * share])

    def eval_batches(self, count: int, *, process: int = 0, processes: int = 1) -> list[np.ndarray]:
        """The first `count` held-out batches (fixed, so evaluations are comparable)."""
        count = min(count, len(self.valid) // self.batch_size)
        share = self.batch_size // processes
        return [
            self.valid.take(
                np.arange(i * self.batch_size, (i + 1) * self.batch_size)[process * share : (process + 1) * share]
            )
            for i in range(count)
        ]


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """The epoch's permutation of the training windows, drawn once per epoch rather than once per batch
    (6 ms a step at 16 tokens a window: as long as a small model's whole step)."""
    order = np.random.default_rng([seed, epoch]).permutation(windows)
    order.flags.writeable = False
    return order


def build_dataset(
    documents: list[str], tokenizer, *, seq_len: int, batch_size: int, seed: int, valid_fraction: float = 0.05
) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(documents))
    held_out = max(1, int(len(documents) * valid_fraction)) if len(documents) > 1 else 0
    valid_docs = [documents[i] for i in order[:held_out]]
    train_docs = [documents[i] for i in order[held_out:]] or valid_docs
    dataset = Dataset(
        Windows(pack(train_docs, tokenizer), seq_len), Windows(pack(valid_docs, tokenizer), seq_len), batch_size, seed
    )
    if len(dataset.train) < batch_size:
        raise DataError(
            f"a batch needs {batch_size} windows of {seq_len + 1} tokens ({batch_size * seq_len + 1} "
            f"tokens), but the training split holds only {len(dataset.train.stream)} tokens; "
            "use more text, a smaller --batch-size or a shorter --config maxlen"
        )
    return dataset
