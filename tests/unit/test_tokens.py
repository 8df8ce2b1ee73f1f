"""Token files: ``python -m composer.tools.tokenize`` writes them, ``data.format = "tokens"``
trains from them memory-mapped, on exactly the windows and losses of the text path."""
import json
import re
import shutil

import numpy as np
import pytest
import torch

from composer.cli.run import run_argv
from composer.data import ByteTokenizer, DataLoader, builtin_paragraphs
from composer.data.sources import is_validation_document
from composer.data.tokens import held_out, read_meta
from composer.tools import inspect_data, tokenize

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id
DEBUG = ["--config", "train_configs/debug_model.toml", "--metrics.enable_tensorboard", "false"]


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """The built-in corpus with the byte tokenizer (the defaults), as a token file."""
    out = tmp_path_factory.mktemp("tokens") / "shakespeare"
    assert tokenize.main(["--out", str(out)]) == 0
    return str(out)


def loaders(folder, dataset="tinyshakespeare", tokenizer="byte", seq_len=64, batch=4, **options):
    """The text path's loader and the token file's, alike in all else."""
    return (DataLoader(dataset, tokenizer, seq_len, batch, 0, 1, **options),
            DataLoader(folder, tokenizer, seq_len, batch, 0, 1, format="tokens", **options))


def assert_same_batches(text, tokens, steps):
    for _ in range(steps):
        want, got = text.next_batch(), tokens.next_batch()
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_file_holds_each_document_packed_as_the_text_path_packs_it(shakespeare):
    meta = read_meta(shakespeare)
    docs = builtin_paragraphs()
    assert {k: meta[k] for k in ("version", "dtype", "vocab_size", "tokenizer", "bos_id",
                                 "eos_id")} == {"version": 1, "dtype": "uint16",
                                                "vocab_size": 258, "tokenizer": "byte",
                                                "bos_id": BOS, "eos_id": EOS}
    sizes = [len(doc.encode()) + 2 for doc in docs]
    assert meta["num_documents"] == len(docs) and meta["num_tokens"] == sum(sizes)
    assert meta["source"] == {"dataset": "tinyshakespeare", "text_field": "text"}
    tokens = np.fromfile(f"{shakespeare}/tokens.bin", dtype=np.uint16)
    offsets = np.fromfile(f"{shakespeare}/offsets.bin", dtype=np.int64)
    assert offsets.tolist() == np.cumsum([0, *sizes[:-1]]).tolist()
    assert tokens[:sizes[0]].tolist() == [BOS, *docs[0].encode(), EOS]


@pytest.mark.parametrize("split,val_fraction,seq_len,documents", [
    ("train", 0.05, 64, True), ("validation", 0.05, 37, True), ("train", 0.0, 128, False),
    ("validation", 0.5, 300, True)])
def test_token_windows_equal_the_text_windows(shakespeare, split, val_fraction, seq_len,
                                              documents):
    text, tokens = loaders(shakespeare, seq_len=seq_len, split=split, val_fraction=val_fraction,
                           document_mask=documents)
    assert tokens.documents == documents and len(tokens.next_batch()) == 2 + documents
    tokens.reset()
    assert tokens._windows.windows_per_epoch == text._windows.windows_per_epoch
    assert isinstance(tokens._windows._tokens, np.memmap)  # read as reached, never whole
    assert_same_batches(text, tokens, 6)


def test_windows_stay_equal_past_an_epoch_and_on_every_rank(shakespeare):
    text, tokens = loaders(shakespeare, seq_len=512, batch=8, document_mask=True)
    steps = text._windows.windows_per_epoch // 8 + 2
    assert_same_batches(text, tokens, steps)
    assert tokens.epoch == text.epoch == 1
    for rank in range(2):
        one = [DataLoader(folder, "byte", 32, 3, rank, 2, format=form, document_mask=True)
               for folder, form in (("tinyshakespeare", "text"), (shakespeare, "tokens"))]
        assert_same_batches(*one, 3)


@pytest.mark.parametrize("consumed", [5, 130])  # 130 batches of 8 windows passes the epoch
def test_a_restored_position_gives_the_same_next_windows(shakespeare, consumed):
    run = DataLoader(shakespeare, "byte", 1000, 8, 0, 1, format="tokens", document_mask=True)
    for _ in range(consumed):
        run.next_batch()
    state = run.state_dict()
    resumed = DataLoader(shakespeare, "byte", 1000, 8, 0, 1, format="tokens", document_mask=True)
    resumed.load_state_dict(state)
    assert resumed.epoch == run.epoch == consumed * 8 // run._windows.windows_per_epoch
    assert_same_batches(run, resumed, 3)


def test_held_out_documents_are_those_of_the_text_path():
    for fraction in (0.0, 0.05, 0.1, 1 / 3, 0.5):
        for first, end in ((0, 5000), (4097, 6000)):
            want = [i for i in range(first, end) if is_validation_document(i, fraction)]
            assert held_out(first, end, fraction).tolist() == want


def test_training_from_the_token_file_has_the_text_paths_losses(shakespeare, tmp_path):
    """Validation runs at the last step, so both splits are compared."""
    runs = {}
    for name, data in (("text", []), ("tokens", ["--data.format", "tokens", "--data.dataset",
                                                 shakespeare])):
        out = tmp_path / name
        assert run_argv([*DEBUG, "--training.steps", "3", "--training.local_batch_size", "2",
                         "--data.seq_len", "64", "--validation.steps", "2", "--metrics.log_freq",
                         "1", "--job.dump_folder", str(out), *data]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(row["loss"], row.get("val_loss")) for row in rows]
    assert len(runs["text"]) == 3 and runs["text"][-1][1] is not None
    assert runs["tokens"] == runs["text"]


def write_words(path, words):
    """A word-level tokenizer.json with ``words`` as ids 0.. and <s>, </s> after them."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {word: i for i, word in enumerate([*words, "<s>", "</s>"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=words[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_a_vocabulary_past_16_bits_is_written_and_read_as_uint32(tmp_path, capsys):
    words = [f"w{i}" for i in range(70000)]
    tokenizer = write_words(tmp_path / "tokenizer.json", words)
    rng = np.random.default_rng(0)
    docs = [" ".join(words[i] for i in rng.integers(65000, 70000, 40)) for _ in range(30)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(docs))
    out = tmp_path / "big_vocab"
    assert tokenize.main(["--dataset", str(corpus), "--tokenizer", tokenizer, "--out",
                          str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: 1260 tokens (uint32), 30 documents, 5280 bytes, ")
    meta = read_meta(out)
    assert (meta["dtype"], meta["vocab_size"], meta["bos_id"]) == ("uint32", 70002, 70000)
    assert np.fromfile(out / "tokens.bin", dtype=np.uint32)[:3].tolist() == [
        70000, *(int(w[1:]) for w in docs[0].split()[:2])]
    text, tokens = loaders(str(out), str(corpus), tokenizer, seq_len=20, batch=3,
                           document_mask=True)
    assert_same_batches(text, tokens, 25)  # 25 batches of 3 passes the epoch of 58 windows
    assert run_argv([*DEBUG, "--validate", "--data.format", "tokens", "--data.dataset",
                     str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.dataset={str(out)!r}: its tokenizer's 70002 ids do not fit the model's "
        f"vocab_size 512")


def test_inspect_data_shows_the_files_documents(shakespeare, capsys):
    assert inspect_data.main(["--data.format", "tokens", "--data.dataset", shakespeare,
                              "--rows", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens"] == [BOS, *builtin_paragraphs()[0].encode(), EOS]


def test_bad_token_folders_are_one_line_before_training(shakespeare, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(shakespeare, copy)
    base = [*DEBUG, "--validate", "--data.format", "tokens", "--data.dataset"]
    assert run_argv([*base, str(copy)]) == 0
    capsys.readouterr()
    meta = json.loads((copy / "meta.json").read_text())
    missing = str(tmp_path / "none")
    assert run_argv([*base, missing]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.dataset={missing!r}: token folder {missing!r} does not exist (write one "
        f"with python -m composer.tools.tokenize)")
    (copy / "meta.json").write_text(json.dumps({**meta, "version": 7}))
    assert run_argv([*base, str(copy)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.dataset={str(copy)!r}: {copy}/meta.json: format version 7 is unknown; "
        f"this composer reads version 1")
    (copy / "meta.json").write_text(json.dumps({**meta, "num_tokens": meta["num_tokens"] + 1}))
    assert run_argv([*base, str(copy)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.dataset={str(copy)!r}: {copy}/tokens.bin holds "
        f"{meta['num_tokens'] * 2} bytes; meta.json says {meta['num_tokens'] + 1} entries of 2 "
        f"bytes")


def test_a_broken_folder_is_named_with_what_is_wrong(shakespeare, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(shakespeare, folder)
    meta = json.loads((folder / "meta.json").read_text())
    for change, message in (({"format": "other"}, "format 'other', not 'composer-tokens'"),
                            ({"dtype": "int8"}, "dtype 'int8'; allowed: uint16, uint32"),
                            ({"num_documents": None}, "lacks num_documents")):
        broken = {k: v for k, v in {**meta, **change}.items() if v is not None}
        (folder / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"^{folder}/meta.json: {re.escape(message)}$"):
            read_meta(folder)
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "offsets.bin").unlink()
    with pytest.raises(ValueError, match=f"^{folder}/offsets.bin is missing$"):
        read_meta(folder)
    with pytest.raises(ValueError, match="has no readable meta.json"):
        read_meta(tmp_path)


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "/no/such.txt"], "--dataset '/no/such.txt': dataset path '/no/such.txt' "
                                    "does not exist"),
    (["--tokenizer", "nope"], "--tokenizer 'nope': tokenizer 'nope' is neither 'byte'"),
    (["--dataset", "{tmp}/bad.jsonl"], "--dataset '{tmp}/bad.jsonl': row 1 (from 0): its text "
                                       "is None, not a string"),
    (["--out", "{tmp}"], "--out '{tmp}' exists and is not an empty folder"),
    (["--rows", "3"], "unknown argument '--rows'"),
])
def test_bad_input_to_the_tool_is_one_line_and_leaves_nothing(tmp_path, capsys, argv, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"other": "b"}\n')
    out = tmp_path / "out"
    argv = [a.format(tmp=tmp_path) for a in ["--out", str(out), *argv]]
    assert tokenize.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {message.format(tmp=tmp_path)}")
    assert len(captured.err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no partial folder
