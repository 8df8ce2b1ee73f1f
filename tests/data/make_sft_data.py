"""Writes the tiny SFT and preference datasets next to this file:
run ``python tests/data/make_sft_data.py``. ``sft_tiny.jsonl`` and
``preference_tiny.jsonl`` here are links to the copies composer ships (and finds by
name: ``data.dataset = "sft_tiny"``) in composer/data/assets/, so they are written there.

Three word tasks a byte-level model can learn in a few hundred CPU steps, on
lower-case words of 3 to 7 letters taken from tinyshakespeare:

    "Reverse: crown\\n" -> "nworc"
    "Upper: crown\\n"   -> "CROWN"
    "Repeat: crown\\n"  -> "crown crown"

- ``sft_tiny.jsonl``: 300 ``{"prompt", "response"}`` rows, 100 of each task in
  shuffled order; prompt and response hold at most 31 bytes, so with bos and
  eos every example fits one window of seq_len 32.
- ``sft_chat_tiny.jsonl``: 40 ``{"messages": [...]}`` rows on other words,
  in a cycle of three: a system message and one user/assistant turn, one
  turn alone, two turns; with the byte tokenizer every example fits one
  window of seq_len 128.
- ``preference_tiny.jsonl``: 120 ``{"prompt", "chosen", "rejected"}`` pairs on
  words drawn apart from the others (a word may recur), the tasks in a cycle:
  chosen is the task done, rejected the word copied as it is (never equal to
  chosen: palindromes are left out), so DPO can learn to prefer doing the task.
  Every answer fits one window of seq_len 32.

The output depends only on the corpus and the fixed seeds, so rerunning it
rewrites the same bytes (tests/unit/test_sft.py checks that).
"""
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
CORPUS = HERE.parents[1] / "composer" / "data" / "assets" / "tinyshakespeare.txt"
TASKS = {
    "Reverse": lambda word: word[::-1],
    "Upper": str.upper,
    "Repeat": lambda word: f"{word} {word}",
}
SYSTEM = "Do what the user asks."
NUM_EXAMPLES = 300
NUM_CHATS = 40
NUM_PAIRS = 120


def corpus_words() -> list[str]:
    """The corpus's distinct lower-case words of 3 to 7 letters, sorted."""
    return sorted(set(re.findall(r"\b[a-z]{3,7}\b", CORPUS.read_text())))


def turn(task: str, word: str) -> tuple[str, str]:
    return f"{task}: {word}\n", TASKS[task](word)


def prompt_response_rows(words: list[str]) -> list[dict]:
    tasks = [task for task in TASKS for _ in range(NUM_EXAMPLES // len(TASKS))]
    random.Random(1).shuffle(tasks)
    rows = []
    for task, word in zip(tasks, words):
        prompt, response = turn(task, word)
        rows.append({"prompt": prompt, "response": response})
    return rows


def chat_rows(words: list[str]) -> list[dict]:
    rng = random.Random(2)
    rows, next_word = [], iter(words)
    for index in range(NUM_CHATS):
        messages = [{"role": "system", "content": SYSTEM}] if index % 3 == 0 else []
        for _ in range(2 if index % 3 == 2 else 1):
            prompt, response = turn(rng.choice(list(TASKS)), next(next_word))
            messages.append({"role": "user", "content": prompt.strip()})
            messages.append({"role": "assistant", "content": response})
        rows.append({"messages": messages})
    return rows


def preference_rows() -> list[dict]:
    words = [w for w in random.Random(3).sample(corpus_words(), 2 * NUM_PAIRS) if w != w[::-1]]
    rows = []
    for index, word in enumerate(words[:NUM_PAIRS]):
        prompt, chosen = turn(list(TASKS)[index % len(TASKS)], word)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": word})
    return rows


def render() -> dict[str, str]:
    """File name -> the jsonl text it holds."""
    words = random.Random(0).sample(corpus_words(), NUM_EXAMPLES + 2 * NUM_CHATS)
    files = {
        "sft_tiny.jsonl": prompt_response_rows(words[:NUM_EXAMPLES]),
        "sft_chat_tiny.jsonl": chat_rows(words[NUM_EXAMPLES:]),
        "preference_tiny.jsonl": preference_rows(),
    }
    return {name: "".join(json.dumps(row) + "\n" for row in rows) for name, rows in files.items()}


def main() -> None:
    for name, text in render().items():
        (HERE / name).write_text(text)


if __name__ == "__main__":
    main()
