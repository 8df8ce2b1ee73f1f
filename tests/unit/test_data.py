import dataclasses
import json
import math
import socket

import pandas as pd
import pytest
import torch

from composer.data import (
    ByteTokenizer,
    DataLoader,
    build_tokenizer,
    load_documents,
    loader,
    sources,
)

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def write_paragraphs(path, docs):
    path.write_text("\n\n".join(docs))
    return str(path)


def numbered_docs(n):
    # Each document packs to exactly 7 byte tokens: bos, five digits, eos.
    return [f"{i:05d}" for i in range(n)]


def packed(docs):
    return [t for doc in docs for t in [BOS, *doc.encode(), EOS]]


def byte_loader(path, seq_len, local_batch_size, dp_rank=0, dp_degree=1, **options):
    tokenizer = ByteTokenizer()
    return DataLoader(path, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree, **options)


def batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want):
        assert torch.equal(x, wx) and torch.equal(y, wy)


@pytest.fixture(params=["memory", "stream"])
def source(request, monkeypatch):
    """Runs a test on the in-memory source and on the streaming (hub) source."""
    if request.param == "stream":
        load = loader.load_documents
        monkeypatch.setattr(
            loader, "load_documents",
            lambda *a, **k: dataclasses.replace(load(*a, **k), local=False)
        )
    return request.param


@pytest.fixture
def corpus(tmp_path):
    return write_paragraphs(tmp_path / "corpus.txt", numbered_docs(40))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([BOS, *ids, EOS]) == text
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)


def test_build_tokenizer_rejects_unknown_name(tmp_path):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    for name in ["bytes", str(tmp_path / "missing.json")]:
        with pytest.raises(ValueError, match="tokenizer") as err:
            build_tokenizer(name)
        assert name in str(err.value) and "byte" in str(err.value)


def save_word_tokenizer(path, specials):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{s: 3 + i for i, s in enumerate(specials)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    if specials:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{specials[0]} $A {specials[1]}",
            special_tokens=[(s, vocab[s]) for s in specials],
        )
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_from_tokenizer_json(tmp_path):
    path = save_word_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    for name in [path, str(tmp_path)]:
        tok = build_tokenizer(name)
        assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (5, 3, 4)
        assert tok.encode("hello world hi") == [1, 2, 0]
        assert tok.decode([3, 1, 2, 4]) == "hello world"


def test_hf_tokenizer_packs_with_its_specials_or_without(tmp_path):
    docs = ["hello world", "world", "hello hello"]
    corpus = write_paragraphs(tmp_path / "c.txt", docs)
    llama_specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    with_specials = build_tokenizer(save_word_tokenizer(tmp_path / "a.json", llama_specials))
    plain = build_tokenizer(save_word_tokenizer(tmp_path / "b.json", []))
    assert (plain.bos_id, plain.eos_id) == (None, None)
    streams = {with_specials: [3, 1, 2, 4, 3, 2, 4, 3, 1, 1, 4], plain: [1, 2, 2, 1, 1]}
    for tok, stream in streams.items():
        x, y = DataLoader(corpus, tok, len(stream) - 1, 1, 0, 1, val_fraction=0).next_batch()
        assert x.tolist() == [stream[:-1]] and y.tolist() == [stream[1:]]


def test_windows_are_consecutive_slices_of_the_packed_stream(corpus, source):
    stream = torch.tensor(packed(numbered_docs(40)))
    seq_len, batch = 10, 3
    loader = byte_loader(corpus, seq_len, batch, val_fraction=0)
    for step, (x, y) in enumerate(batches(loader, 4)):
        assert x.shape == y.shape == (batch, seq_len) and x.dtype == y.dtype == torch.int64
        for row in range(batch):
            start = (step * batch + row) * (seq_len + 1)
            assert torch.equal(x[row], stream[start : start + seq_len])
            assert torch.equal(y[row], stream[start + 1 : start + seq_len + 1])
    assert loader.windows_consumed == 12 and loader.epoch == 0


def test_ranks_read_disjoint_slices_that_make_up_the_global_batch(corpus, source):
    # seq_len 16: every window holds a whole numbered document, so no two windows are equal.
    single = batches(byte_loader(corpus, 16, 8, val_fraction=0), 3)
    ranks = [batches(byte_loader(corpus, 16, 2, r, 4, val_fraction=0), 3) for r in range(4)]
    for step in range(3):
        rows = [{tuple(w.tolist()) for w in ranks[r][step][0]} for r in range(4)]
        assert all(len(rows[a] & rows[b]) == 0 for a in range(4) for b in range(a + 1, 4))
        for i in (0, 1):
            assert torch.equal(torch.cat([ranks[r][step][i] for r in range(4)]), single[step][i])


def test_two_ranks_two_rounds_equal_one_rank_one_round(corpus):
    x, y = byte_loader(corpus, 12, 8, val_fraction=0).next_batch()
    ranks = [batches(byte_loader(corpus, 12, 2, r, 2, val_fraction=0), 2) for r in range(2)]
    order = [ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]]
    assert torch.equal(torch.cat([b[0] for b in order]), x)
    assert torch.equal(torch.cat([b[1] for b in order]), y)


@pytest.mark.parametrize("consumed", [1, 4])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, source, consumed):
    # 10 documents of 7 tokens, windows of 7: 10 windows an epoch, 4 per batch over 2 ranks,
    # so resuming after 4 batches crosses into the second epoch.
    corpus = write_paragraphs(tmp_path / "tiny.txt", numbered_docs(10))
    def rank_one():
        return byte_loader(corpus, 6, 2, dp_rank=1, dp_degree=2, val_fraction=0)

    uninterrupted = rank_one()
    want = batches(uninterrupted, consumed + 3)[consumed:]
    interrupted = rank_one()
    batches(interrupted, consumed)
    state = interrupted.state_dict()
    assert state == {"windows_consumed": 4 * consumed, "seq_len": 6}
    resumed = rank_one()
    resumed.load_state_dict(state)
    assert resumed.epoch == (4 * consumed) // 10
    assert_same_batches(batches(resumed, 3), want)
    assert resumed.epoch == uninterrupted.epoch == (4 * consumed + 12) // 10


def test_resume_rejects_a_different_seq_len(corpus):
    state = byte_loader(corpus, 6, 1).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        byte_loader(corpus, 7, 1).load_state_dict(state)


def test_next_epoch_starts_over_and_drops_the_short_tail(tmp_path, source):
    corpus = write_paragraphs(tmp_path / "tiny.txt", numbered_docs(3))  # 21 tokens
    loader = byte_loader(corpus, 7, 1, val_fraction=0)
    first_epoch = batches(loader, 2)  # two windows of 8; the last 5 tokens are dropped
    assert loader.epoch == 1
    assert_same_batches(batches(loader, 2), first_epoch)
    assert loader.epoch == 2 and loader.windows_consumed == 4


def documents_read(corpus, split, val_fraction):
    """The numbers of the documents one epoch of a split holds (one document per window)."""
    loader = byte_loader(corpus, 6, 1, split=split, val_fraction=val_fraction)
    numbers = []
    while loader.epoch == 0:
        x, y = loader.next_batch()
        assert x[0, 0] == BOS and y[0, -1] == EOS
        numbers.append(int(ByteTokenizer().decode(x[0].tolist())))
    return numbers


def test_validation_documents_are_held_out_from_training(corpus, source):
    val = documents_read(corpus, "validation", 0.25)
    train = documents_read(corpus, "train", 0.25)
    assert val == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert train == [i for i in range(40) if i not in val]
    assert len(documents_read(corpus, "validation", 0.05)) == math.floor(40 * 0.05)
    assert documents_read(corpus, "train", 0) == list(range(40))


def test_reset_reads_the_same_validation_batches_again(corpus, source):
    loader = byte_loader(corpus, 5, 2, split="validation", val_fraction=0.5)
    first = batches(loader, 3)
    loader.reset()
    assert loader.windows_consumed == 0
    assert_same_batches(batches(loader, 3), first)


def test_local_text_json_jsonl_parquet_and_folders_load(tmp_path):
    docs = ["first doc", "second — doc", "third"]
    assert list(load_documents(write_paragraphs(tmp_path / "a.txt", docs))) == docs
    lines = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)]
    (tmp_path / "b.jsonl").write_text("".join(lines))
    assert list(load_documents(str(tmp_path / "b.jsonl"))) == docs
    (tmp_path / "c.json").write_text(json.dumps([{"body": d} for d in docs]))
    assert list(load_documents(str(tmp_path / "c.json"), text_field="body")) == docs
    pd.DataFrame({"content": docs, "n": [1, 2, 3]}).to_parquet(tmp_path / "d.parquet")
    assert list(load_documents(str(tmp_path / "d.parquet"), text_field="content")) == docs
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in (1, 0):
        pd.DataFrame({"text": docs[i::2]}).to_parquet(shards / f"part-{i}.parquet")
    assert list(load_documents(str(shards))) == [docs[0], docs[2], docs[1]]


def test_missing_text_field_names_it_and_the_columns(tmp_path):
    pd.DataFrame({"content": ["a"], "n": [1]}).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"'text'.*\['content', 'n'\]"):
        load_documents(str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match="'body'"):
        byte_loader(write_paragraphs(tmp_path / "a.txt", ["x"]), 4, 1, text_field="body")


def test_bad_paths_and_files_are_named(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty_dir").mkdir()
    cases = {
        str(tmp_path / "nope.txt"): "does not exist",
        "./missing_folder": "does not exist",
        str(tmp_path / "x.csv"): "cannot read",
        str(tmp_path / "empty.jsonl"): "empty",
        str(tmp_path / "empty_dir"): "holds no",
    }
    for path, reason in cases.items():
        with pytest.raises(ValueError, match=reason) as err:
            load_documents(path)
        assert repr(path) in str(err.value)


def test_loader_rejects_bad_sizes_and_empty_splits(corpus, tmp_path, source):
    cases = [
        (dict(seq_len=0), "seq_len = 0"),
        (dict(seq_len=400), "280 tokens, fewer than one window of seq_len \\+ 1 = 401"),
        (dict(split="validation", val_fraction=0), "validation split .* is empty"),
        (dict(split="test"), "split = 'test'"),
        (dict(dp_rank=2, dp_degree=2), "dp_rank 2"),
    ]
    for overrides, message in cases:
        args = dict(seq_len=8, local_batch_size=1, val_fraction=0) | overrides
        with pytest.raises(ValueError, match=message):
            byte_loader(corpus, **args)
    with pytest.raises(ValueError, match="is empty"):
        byte_loader(write_paragraphs(tmp_path / "e.txt", []), 4, 1)


def test_local_data_never_touches_the_network(tmp_path, monkeypatch):
    lookups = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: lookups.append(a[0]) or [])
    corpus = write_paragraphs(tmp_path / "a.txt", numbered_docs(4))
    byte_loader(corpus, 4, 1).next_batch()
    assert list(load_documents("tinyshakespeare"))[0].startswith("First Citizen:")
    assert lookups == []


def test_builtin_corpus_is_read_without_datasets_and_yields_its_documents():
    """The built-in corpus skips ``datasets`` (a second of every rank's start-up)
    and yields exactly the documents of its text builder, paragraph by paragraph."""
    import datasets
    rows = datasets.load_dataset("text", data_files=[str(sources._BUILTIN_FILE)], split="train",
                                 streaming=True, sample_by="paragraph")
    assert list(load_documents("tinyshakespeare")) == [row["text"] for row in rows]


def test_builtin_corpus_loads_about_a_megabyte_of_tokens():
    docs = list(load_documents("tinyshakespeare"))
    num_tokens = sum(len(d.encode()) + 2 for d in docs)
    assert len(docs) > 7000 and 1_100_000 < num_tokens < 1_150_000
    loader = DataLoader("tinyshakespeare", "byte", 64, 2, 0, 1)
    x, y = loader.next_batch()
    assert ByteTokenizer().decode(x[0].tolist()).startswith("First Citizen:")
    assert x[0, 0] == BOS and torch.equal(x[0, 1:], y[0, :-1])


def test_the_builtin_corpus_is_tokenized_once_a_process_per_tokenizer_and_split():
    """A launch runs many jobs in each process: the packaged corpus's token stream
    is kept, equal windows come back without encoding again, and another
    tokenizer's stream replaces it."""
    from composer.data import loader

    class Counting(ByteTokenizer):
        identity = ("counting-bytes",)
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    tokenizer = Counting()
    first = DataLoader("tinyshakespeare", tokenizer, 32, 4, 0, 1, document_mask=True)
    encoded = Counting.calls
    again = DataLoader("tinyshakespeare", tokenizer, 64, 4, 0, 1, document_mask=True)
    assert encoded > 1000 and Counting.calls == encoded
    for a, b in zip(first.next_batch(), DataLoader("tinyshakespeare", ByteTokenizer(), 32, 4, 0,
                                                    1, document_mask=True).next_batch()):
        assert torch.equal(a, b)
    assert again.next_batch()[0].shape == (4, 64)
    assert {key[0] for key in loader._BUILTIN_STREAMS} == {("byte",)}
