import importlib.util
import json
import logging
from pathlib import Path

import pandas as pd
import pytest
import torch

from composer.data import IGNORE_INDEX, ByteTokenizer, DataLoader
from composer.data.sft import (
    chat_tokens,
    example_tokens,
    load_examples,
    parse_columns,
    prompt_response_tokens,
)

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id
DATA = Path(__file__).parents[1] / "data"


class PlainByteTokenizer(ByteTokenizer):
    """Bytes without bos or eos, like a tokenizer.json that defines neither."""

    bos_id = None
    eos_id = None


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def qa_rows(n):
    # Prompts and responses of varying lengths, so windows differ in where the response starts.
    return [{"prompt": f"Q{i}:" + "p" * (i % 4), "response": "r" * (1 + i % 5)} for i in range(n)]


def sft_loader(path, seq_len, local_batch_size, dp_rank=0, dp_degree=1, **options):
    options = {"val_fraction": 0, "format": "sft"} | options
    return DataLoader(path, ByteTokenizer(), seq_len, local_batch_size, dp_rank, dp_degree,
                      **options)


def learned_targets(y):
    return y[y != IGNORE_INDEX].tolist()


def test_prompt_tokens_get_no_loss_and_the_response_and_eos_are_the_targets(tmp_path):
    rows = qa_rows(6)
    x, y = sft_loader(write_jsonl(tmp_path / "qa.jsonl", rows), 24, 6).next_batch()
    for i, row in enumerate(rows):
        prompt, response = [BOS, *row["prompt"].encode()], [*row["response"].encode(), EOS]
        tokens = prompt + response
        pads = 25 - len(tokens)
        assert x[i].tolist() == tokens + [EOS] * (pads - 1)
        ignored_prompt, ignored_pads = [IGNORE_INDEX] * (len(prompt) - 1), [IGNORE_INDEX] * pads
        assert y[i].tolist() == ignored_prompt + response + ignored_pads


def test_messages_learn_exactly_the_assistant_contents_and_their_eos():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    tokens, mask = chat_tokens(messages, ByteTokenizer())
    unlearned = [
        [BOS, *b"<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"],
        [*b"<|user|>\nbye\n<|assistant|>\n"],
    ]
    learned = [[*b"hello", EOS], [*b"ciao", EOS]]
    assert tokens == unlearned[0] + learned[0] + unlearned[1] + learned[1]
    assert mask == [0] * len(unlearned[0]) + [1] * 6 + [0] * len(unlearned[1]) + [1] * 5
    assert example_tokens({"messages": messages}, ByteTokenizer()) == (tokens, mask)


def test_chat_windows_target_only_the_assistant_turns(tmp_path):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    x, y = sft_loader(path, 40, 1).next_batch()
    assert ByteTokenizer().decode(x[0].tolist()) == "<|user|>\n2+2?\n<|assistant|>\n4"
    assert learned_targets(y) == [*b"4", EOS]
    assert y[0, len("<|user|>\n2+2?\n<|assistant|>\n")].item() == ord("4")


def test_bos_and_eos_are_left_out_when_the_tokenizer_has_none():
    tokenizer = PlainByteTokenizer()
    assert prompt_response_tokens("ab", "cd", tokenizer) == ([*b"abcd"], [0, 0, 1, 1])
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    header = b"<|user|>\na\n<|assistant|>\n"
    assert chat_tokens(chat, tokenizer) == ([*header, *b"b"], [0] * len(header) + [1])


def test_padding_targets_every_response_token_and_eos_and_ignores_the_pads(tmp_path):
    rows = qa_rows(8)
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    loader = sft_loader(path, 32, 4)
    for step in range(2):
        x, y = loader.next_batch()
        batch_rows = rows[4 * step : 4 * step + 4]
        assert (y != IGNORE_INDEX).sum() == sum(len(row["response"]) + 1 for row in batch_rows)
        for i, row in enumerate(batch_rows):
            length = 2 + len(row["prompt"]) + len(row["response"])
            assert (x[i, length:] == EOS).all() and (y[i, length - 1 :] == IGNORE_INDEX).all()


def test_packing_cuts_the_concatenated_examples_into_consecutive_windows(tmp_path):
    rows = qa_rows(10)
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    examples = list(load_examples(path, ByteTokenizer()))
    tokens = torch.tensor([t for ids, _ in examples for t in ids])
    mask = torch.tensor([m for _, learned in examples for m in learned], dtype=torch.bool)
    labels = tokens.masked_fill(~mask, IGNORE_INDEX)
    seq_len, batch = 9, 3
    loader = sft_loader(path, seq_len, batch, sft_packing=True)
    num_windows = len(tokens) // (seq_len + 1)
    assert num_windows == 9  # three batches read one whole epoch
    for step in range(num_windows // batch):
        x, y = loader.next_batch()
        for row in range(batch):
            start = (step * batch + row) * (seq_len + 1)
            assert torch.equal(x[row], tokens[start : start + seq_len])
            assert torch.equal(y[row], labels[start + 1 : start + seq_len + 1])
    assert loader.epoch == 1


def test_packed_windows_of_whole_examples_target_every_response_token_and_eos(tmp_path):
    # Every example is 8 tokens (bos, 3 of prompt, 3 of response, eos): two fill a window.
    rows = [{"prompt": f"{i}:=", "response": f"{i:03d}"} for i in range(10)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    x, y = sft_loader(path, 15, 5, sft_packing=True).next_batch()
    assert x.shape == (5, 15) and (x[:, 0] == BOS).all() and (x[:, 8] == BOS).all()
    assert (y != IGNORE_INDEX).sum() == sum(len(row["response"]) + 1 for row in rows)
    assert learned_targets(y[0]) == [*b"000", EOS, *b"001", EOS]


def test_a_long_example_is_truncated_to_the_window_with_one_warning(tmp_path, caplog):
    rows = [{"prompt": "Q:", "response": "x" * 50}, {"prompt": "Q:", "response": "y"}]
    with caplog.at_level(logging.WARNING, logger="composer"):
        x, y = sft_loader(write_jsonl(tmp_path / "qa.jsonl", rows), 16, 2).next_batch()
    assert x.shape == y.shape == (2, 16)
    assert y[0].tolist() == [IGNORE_INDEX] * 2 + [ord("x")] * 14
    assert learned_targets(y[1]) == [ord("y"), EOS]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 2 examples are longer than seq_len + 1 = 17" in warnings[0]


@pytest.mark.parametrize("packing", [False, True])
def test_two_ranks_together_read_the_one_rank_batches(packing):
    path = str(DATA / "sft_tiny.jsonl")
    single = sft_loader(path, 32, 4, sft_packing=packing)
    ranks = [sft_loader(path, 32, 2, r, 2, sft_packing=packing) for r in range(2)]
    for _ in range(3):
        want = single.next_batch()
        got = [rank.next_batch() for rank in ranks]
        for i in (0, 1):
            assert torch.equal(torch.cat([got[0][i], got[1][i]]), want[i])
    assert single.windows_consumed == ranks[1].windows_consumed == 12


@pytest.mark.parametrize("packing", [False, True])
def test_resume_from_state_dict_gives_the_same_next_batches(tmp_path, packing):
    # 10 examples: the resumed run crosses into the second epoch.
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows(10))
    uninterrupted = sft_loader(path, 7, 3, sft_packing=packing)
    want = [uninterrupted.next_batch() for _ in range(6)][2:]
    interrupted = sft_loader(path, 7, 3, sft_packing=packing)
    interrupted.next_batch(), interrupted.next_batch()
    resumed = sft_loader(path, 7, 3, sft_packing=packing)
    resumed.load_state_dict(interrupted.state_dict())
    for wx, wy in want:
        x, y = resumed.next_batch()
        assert torch.equal(x, wx) and torch.equal(y, wy)
    assert resumed.epoch == uninterrupted.epoch >= 1


def test_examples_not_windows_are_held_out_for_validation(tmp_path):
    rows = [{"prompt": "Q:", "response": f"{i}"} for i in range(8)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)

    def responses(split, num_windows):
        loader = sft_loader(path, 8, num_windows, split=split, val_fraction=0.25)
        _, y = loader.next_batch()
        assert loader.epoch == 1
        return [ByteTokenizer().decode(learned_targets(row)) for row in y]

    assert responses("validation", 2) == ["3", "7"]
    assert responses("train", 6) == ["0", "1", "2", "4", "5", "6"]


def test_json_and_parquet_files_load_like_jsonl(tmp_path):
    rows = qa_rows(3)
    want = list(load_examples(write_jsonl(tmp_path / "a.jsonl", rows), ByteTokenizer()))
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "c.parquet")
    for name in ("b.json", "c.parquet"):
        assert list(load_examples(str(tmp_path / name), ByteTokenizer())) == want
    chat = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    pd.DataFrame(chat).to_parquet(tmp_path / "d.parquet")
    assert list(load_examples(str(tmp_path / "d.parquet"), ByteTokenizer())) == [
        chat_tokens(chat[0]["messages"], ByteTokenizer())
    ]


def test_bad_rows_name_the_dataset_the_row_and_the_allowed_forms(tmp_path):
    rows = qa_rows(2) + [{"text": "no prompt"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 2 .*'prompt' and 'response'; 'messages'") as e:
        sft_loader(path, 16, 1)
    assert repr(path) in str(e.value) and "['text']" in str(e.value)
    chat = [{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}]
    with pytest.raises(ValueError, match=r"row 0 .*message 1 .*'robot'.*'system' \| 'user'"):
        sft_loader(write_jsonl(tmp_path / "chat.jsonl", chat), 16, 1)


def test_instructions_and_conversations_are_chats_and_columns_rename(tmp_path):
    """The instruction layout (instruction, optional input, output) and from/value
    conversations read as the messages they stand for; data.columns maps other names."""
    tokenizer = ByteTokenizer()
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    cases = [
        ({"instruction": "Add.", "input": "2 + 2", "output": "4"}, [user("Add.\n\n2 + 2"),
                                                                      bot("4")]),
        ({"instruction": "Greet.", "input": "", "output": "Hi"}, [user("Greet."), bot("Hi")]),
        ({"conversations": [{"from": "system", "value": "Be brief."},
                            {"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hi."}]},
         [{"role": "system", "content": "Be brief."}, user("Hi?"), bot("Hi.")]),
    ]
    for row, messages in cases:
        assert example_tokens(row, tokenizer) == chat_tokens(messages, tokenizer), row
    renamed = {"question": "Q", "answer": "A"}
    columns = parse_columns("prompt=question, response=answer")
    assert example_tokens(renamed, tokenizer, columns) == prompt_response_tokens("Q", "A",
                                                                                 tokenizer)
    path = write_jsonl(tmp_path / "renamed.jsonl", [renamed] * 4)
    loader = sft_loader(path, 8, 1, columns="prompt=question,response=answer")
    assert learned_targets(loader.next_batch()[1]) == [ord("A"), EOS]
    with pytest.raises(ValueError, match=r"'answer=response': allowed: <field>=<column>"):
        parse_columns("answer=response")
    with pytest.raises(ValueError, match=r"conversations turn 0 .*'from': 'system' \| 'human'"):
        example_tokens({"conversations": [{"from": "robot", "value": "b"}]}, tokenizer)


def test_empty_splits_and_too_few_tokens_are_clear_errors(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows(2))
    with pytest.raises(ValueError, match=r"validation split of dataset .* has no examples"):
        sft_loader(path, 16, 1, split="validation")
    with pytest.raises(ValueError, match="fewer than one window of seq_len \\+ 1 = 101"):
        sft_loader(path, 100, 1, sft_packing=True)
    with pytest.raises(ValueError, match="validation split .* is empty"):
        sft_loader(path, 16, 1, split="validation", sft_packing=True)
    with pytest.raises(ValueError, match="format = 'chat'"):
        sft_loader(path, 16, 1, format="chat")


def windows_per_epoch(loader):
    while loader.epoch == 0:
        loader.next_batch()
    return loader.windows_consumed


def test_the_shipped_datasets_load_at_their_sizes_and_fit_their_windows(caplog):
    spec = importlib.util.spec_from_file_location("make_sft_data", DATA / "make_sft_data.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    assert maker.render() == {name: (DATA / name).read_text() for name in maker.render()}
    assert (DATA / "sft_tiny.jsonl").stat().st_size < 80_000
    with caplog.at_level(logging.WARNING, logger="composer"):
        for name, seq_len, num_examples in [("sft_tiny", 32, 300), ("sft_chat_tiny", 128, 40)]:
            path = str(DATA / f"{name}.jsonl")
            train = sft_loader(path, seq_len, 1, val_fraction=0.05)
            val = sft_loader(path, seq_len, 1, split="validation", val_fraction=0.05)
            assert windows_per_epoch(train) == num_examples - num_examples // 20
            assert windows_per_epoch(val) == num_examples // 20
    assert not caplog.records  # no example was truncated
    x, y = sft_loader(str(DATA / "sft_tiny.jsonl"), 32, 1).next_batch()
    assert ByteTokenizer().decode(x[0].tolist()).startswith("Repeat: kill\nkill kill")
    assert learned_targets(y) == [*b"kill kill", EOS]
