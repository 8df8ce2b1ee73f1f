"""Chats through the tokenizer's own chat template (composer/data/chat.py), with
transformers as the reference: the ids composer trains on are
``apply_chat_template(messages, tokenize=True)``'s, and the learned tokens are those
transformers marks with ``return_assistant_tokens_mask`` (templates with ``{%
generation %}``), or each assistant content and its end token; for three templates,
multi-turn, with and without a system prompt, non-ASCII text. ``inspect_data`` shows
what training reads."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from composer.data import build_tokenizer, set_chat_template
from composer.data.chat import GENERATION, _render_jinja2
from composer.data.sft import chat_prompt, chat_tokens
from composer.tools import inspect_data

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<|system|>", "<|user|>",
            "<|assistant|>"]
TEMPLATES = {
    # ChatML, the assistant's turns in generation blocks
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
        "{% endgeneration %}\n{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # Llama-3's headers, no generation blocks: the content and its <|eot_id|> are learned
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"),
    # a system prompt by default, transformers' extensions, text after an assistant turn
    "system_default": (
        "{% if messages[0]['role'] != 'system' %}<|system|>\nYou help. Year "
        "{{ strftime_now('%Y') }}.{{ eos_token }}\n{% endif %}"
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
        "{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n"
        "{% endfor %}"),
}
CHATS = [
    [{"role": "user", "content": "Who wrote Hamlet?"},
     {"role": "assistant", "content": "Shakespeare, around 1600."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Say café twice."},
     {"role": "assistant", "content": "café café"},
     {"role": "user", "content": "And once more?"},
     {"role": "assistant", "content": "café — once."}],
]


def write_tokenizer(folder: Path, template: str) -> Path:
    """A small byte-level BPE (the tokenizers package) with the templates' special
    tokens, and a tokenizer_config.json holding ``template``, as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps(chat) for chat in CHATS] * 4 + ["To be, or not to be, that is it."]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "</s>", "chat_template": template}))
    return folder


@pytest.fixture(scope="module", params=list(TEMPLATES))
def folder(request, tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])


def theirs(folder: Path, chat: list[dict]) -> tuple[list[int], list[int] | None]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    generation = bool(GENERATION.search(tokenizer.chat_template))
    out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=generation)
    return list(out["input_ids"]), (list(out["assistant_masks"]) if generation else None)


@pytest.mark.parametrize("chat", CHATS, ids=["one_turn", "system_multi_turn"])
def test_tokens_and_learned_positions_are_transformers_own(folder, chat):
    ours = build_tokenizer(str(folder))
    assert ours.chat is not None and ours.eos_id == ours._tokenizer.token_to_id("</s>")
    tokens, learn = chat_tokens(chat, ours)
    ids, mask = theirs(folder, chat)
    assert tokens == ids
    if mask is not None:
        assert learn == mask and sum(mask) > 0
    else:  # each learned stretch is an assistant's content and the template's end of turn
        stretches = [ours.decode([t for t, _ in run], skip_special_tokens=False)
                     for learned, run in itertools.groupby(zip(tokens, learn), lambda p: p[1])
                     if learned]
        assert stretches == [m["content"] + "<|eot_id|>" for m in chat
                             if m["role"] == "assistant"]


def test_a_chat_to_answer_is_transformers_generation_prompt(folder):
    """What generation reads (``--chat``): the template's text with the assistant's turn
    opened, as ``apply_chat_template(add_generation_prompt=True)`` tokenizes it; the
    built-in template opens it with ``<|assistant|>``."""
    ours = build_tokenizer(str(folder))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        asked = chat[:-1]  # up to the last user turn
        assert chat_prompt(asked, ours) == list(tokenizer.apply_chat_template(
            asked, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    byte = build_tokenizer("byte")
    assert byte.decode(chat_prompt(CHATS[0][:1], byte), skip_special_tokens=False) == \
        "<bos><|user|>\nWho wrote Hamlet?\n<|assistant|>\n"


def test_jinja2_alone_renders_as_transformers_does(folder):
    """Without transformers, jinja2 and composer's extensions give the same text and
    generation spans."""
    from transformers.utils.chat_template_utils import render_jinja_template
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    specials = {"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}
    for chat in CHATS:
        texts, spans = render_jinja_template([chat], chat_template=template,
                                             return_assistant_tokens_mask=True, **specials)
        text, found = _render_jinja2(template, chat, specials)
        assert text == texts[0] and found == [tuple(s) for s in spans[0]]
        prompt = render_jinja_template([chat[:-1]], chat_template=template,
                                       add_generation_prompt=True, **specials)[0][0]
        assert _render_jinja2(template, chat[:-1], specials, True)[0] == prompt


def test_a_template_may_be_chosen_and_the_builtin_stays_the_fallback(folder, tmp_path):
    ours = build_tokenizer(str(folder))
    set_chat_template(ours, "builtin")
    assert ours.chat is None
    assert chat_tokens(CHATS[0], ours)[0][0] == ours.bos_id  # the built-in adds bos
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(TEMPLATES["chatml"])
    set_chat_template(ours, str(jinja))
    assert ours.chat.source == str(jinja)
    with pytest.raises(ValueError, match="allowed: auto, builtin, or the path of a Jinja file"):
        set_chat_template(ours, str(tmp_path / "missing.jinja"))
    byte = build_tokenizer("byte")
    set_chat_template(byte, str(jinja))  # a Jinja template on the byte tokenizer: bytes
    tokens, learn = chat_tokens(CHATS[0], byte)
    assert bytes(t for t, m in zip(tokens, learn) if m) == b"Shakespeare, around 1600.<|im_end|>"


def test_inspect_data_shows_what_training_reads(tmp_path, capsys):
    folder = write_tokenizer(tmp_path / "tok", TEMPLATES["chatml"])
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": chat}) for chat in CHATS) + "\n")
    argv = ["--data.format", "sft", "--data.dataset", str(data), "--data.tokenizer",
            str(folder)]
    assert inspect_data.main([*argv, "--rows", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = build_tokenizer(str(folder))
    assert [(r["tokens"], r["learn"]) for r in rows] == [chat_tokens(c, ours) for c in CHATS]
    assert rows[0]["text"].startswith("<|im_start|>user\nWho wrote Hamlet?<|im_end|>")
    assert inspect_data.main([*argv, "--rows", "1"]) == 0
    assert "[Shakespeare, around 1600.<|im_end|>]" in capsys.readouterr().out
    assert inspect_data.main([*argv, "--rows", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rows 0: allowed: a whole number from 1"


def test_the_template_and_columns_are_checked_at_start_and_logged(tmp_path, monkeypatch,
                                                                  capsys):
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = write_tokenizer(tmp_path / "tok", TEMPLATES["chatml"])
    sft = ["--validate", "--data.format", "sft", "--data.dataset", "tests/data/sft_tiny.jsonl"]
    assert run_argv([*sft, "--data.chat_template", str(tmp_path / "none.jinja")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data.chat_template={str(tmp_path / 'none.jinja')!r}: allowed: auto, builtin, "
        f"or the path of a Jinja file")
    assert run_argv([*sft, "--data.columns", "answer=response"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: data.columns='answer=response': 'answer=response': allowed: <field>=<column>, "
        "field one of conversations, input, instruction, messages, output, prompt, response")
    assert run_argv(sft) == 0
    assert ("chats render with composer's built-in template (<|role|> headers): the tokenizer "
            "has none") in capsys.readouterr().out
    assert run_argv([*sft, "--data.tokenizer", str(folder), "--model.overrides",
                     "vocab_size=512"]) == 0
    assert f"chats render with the chat template of {folder}" in capsys.readouterr().out


def test_an_export_carries_the_tokenizer_its_template_and_a_generation_config(tmp_path):
    """transformers reads the files an export carries: the tokenizer, the chat template
    training used (here one given as a Jinja file) and the ids a generation ends at."""
    from composer.data.tokenizer import export_files
    folder = write_tokenizer(tmp_path / "tok", TEMPLATES["llama3"])
    ours = build_tokenizer(str(folder))
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(TEMPLATES["chatml"])
    set_chat_template(ours, str(jinja))
    out = tmp_path / "export"
    out.mkdir()
    for path in export_files(ours, tmp_path / "scratch"):
        (out / path.name).write_bytes(path.read_bytes())
    assert theirs(out, CHATS[1]) == chat_tokens(CHATS[1], ours)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert [p.name for p in export_files(build_tokenizer("byte"), tmp_path / "b")] == [
        "generation_config.json"]
