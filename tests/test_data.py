"""Data: tokenizer, built-in corpus, packing, splits and per-process batch shares."""

import numpy as np
import pytest

from minigpt_model.corpus import default_corpus
from minigpt_model.data import DataError, build_dataset, pack, read_documents
from minigpt_model.tokenizer import ByteTokenizer, GPT2Tokenizer, TokenizerUnavailable, pad_vocab


def test_byte_tokenizer_round_trip_and_padded_vocab():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("Once upon a time, naïve")) == "Once upon a time, naïve"
    assert tok.vocab_size == 320 and tok.vocab_size % 64 == 0 and tok.eot == 256
    assert pad_vocab(50257) == 50304


def test_gpt2_tokenizer_never_downloads(monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerUnavailable) as exc:
        GPT2Tokenizer()
    assert "tiktoken" in str(exc.value)


def test_default_corpus_is_deterministic_story_text():
    a, b = default_corpus(stories=50, seed=3), default_corpus(stories=50, seed=3)
    assert a == b and a != default_corpus(stories=50, seed=4)
    assert len(default_corpus()) > 3_000_000
    docs = read_documents(None)
    assert len(docs) == 12000 and len(set(docs)) > 11000


def test_packing_and_shifted_windows():
    tok = ByteTokenizer()
    stream = pack(["ab", "c"], tok)
    assert stream.tolist() == [97, 98, 256, 99, 256]
    data = build_dataset(["abcdefgh"] * 40, tok, seq_len=4, batch_size=2, seed=0)
    window = data.train.take(np.array([0]))[0]
    assert window.shape == (5,) and window[:4].tolist() == data.train.stream[:4].tolist()
    assert data.train.take(np.array([1]))[0][0] == window[-1]  # consecutive windows share one token


def test_batches_are_deterministic_and_split_between_processes():
    data = build_dataset(read_documents(None)[:400], ByteTokenizer(), seq_len=32, batch_size=8, seed=1)
    np.testing.assert_array_equal(data.batch(7), data.batch(7))
    assert not np.array_equal(data.batch(7), data.batch(8))
    halves = [data.batch(7, process=p, processes=2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), data.batch(7))
    # a new epoch reshuffles
    epoch = data.steps_per_epoch
    assert not np.array_equal(data.batch(0), data.batch(epoch))


def test_held_out_documents_are_disjoint_from_training():
    tok = ByteTokenizer()
    docs = [f"document number {i}" for i in range(100)]
    data = build_dataset(docs, tok, seq_len=8, batch_size=2, seed=0)

    def documents_of(stream):
        parts = np.split(stream, np.flatnonzero(stream == tok.eot) + 1)
        return {tok.decode(part) for part in parts if len(part) > 1}

    valid = {d.rstrip() for d in documents_of(data.valid.stream)}
    train = {d.rstrip() for d in documents_of(data.train.stream)}
    assert len(valid) == 5 and not valid & train and valid | train == set(docs)


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_documents([str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        read_documents([str(empty)])
    with pytest.raises(DataError, match="a batch needs 32 windows"):
        build_dataset(["a short story"] * 3, ByteTokenizer(), seq_len=64, batch_size=32, seed=0)
