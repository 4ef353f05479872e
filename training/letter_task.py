"""Labelled tasks small enough for the tiny model to make progress on, on a
CPU, in a few GRPO steps, with one verifier (`reward`: the fraction of the
response's characters that are the row's answer):

- `last`: "Last letter of abba" -> "a". The words use a two-letter alphabet;
  the answers take turns between a and b. The tiny model learns to answer
  with a or b (0.5) but not, in a few steps, which one.
- `repeat`: "aaaaaaaaa" -> "a", the letter the prompt repeats (8 to 15
  times). The whole prompt differs between the two answers, so the tiny
  model learns to read it within a few steps: the CLI's demo.

    python -m training.letter_task data/letter_task.jsonl   # writes a dataset
    python -m training.letter_task data/letter_repeat.jsonl --kind repeat

Rows: `{"id", "prompt", "answer", "data_source"}`; the verifying reward
(`reward`, batch style) reads the answer from the row's label.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from training.rewards import RewardInput

ALPHABET = "ab"
DATA_SOURCE = "letter_task"
REPEAT_SOURCE = "letter_repeat"


def make_rows(count: int, seed: int = 0, length: int = 4) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        # Answers take turns, so a policy that always gives one letter scores
        # 1/len(ALPHABET), and only answering from the prompt scores more.
        word = (
            "".join(rng.choice(ALPHABET) for _ in range(length - 1)) + ALPHABET[i % len(ALPHABET)]
        )
        rows.append(
            {
                "id": f"letter-{i:04d}",
                "prompt": f"Last letter of {word}",
                "answer": word[-1],
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def make_repeat_rows(count: int, min_length: int = 8) -> list[dict[str, str]]:
    """Row i: its answer repeated `min_length + i // len(ALPHABET)` times;
    the answers take turns, as in `make_rows`."""
    rows = []
    for i in range(count):
        letter = ALPHABET[i % len(ALPHABET)]
        rows.append(
            {
                "id": f"repeat-{i:04d}",
                "prompt": letter * (min_length + i // len(ALPHABET)),
                "answer": letter,
                "data_source": REPEAT_SOURCE,
            }
        )
    return rows


def score_one(response: str, answer: str) -> float:
    """The fraction of the response's characters that are the answer: "d" or
    "dd" is right, "dx" half right, "" wrong."""
    if not response:
        return 0.0
    return sum(ch == answer for ch in response) / len(response)


def reward(samples: list[RewardInput]) -> list[float]:
    """The task's verifier (batch style: `--reward training.letter_task:reward`)."""
    return [score_one(s.response, s.label) for s in samples]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="(kind last) the words' seed")
    parser.add_argument("--kind", choices=("last", "repeat"), default="last")
    args = parser.parse_args(argv)
    rows = make_rows(args.count, args.seed) if args.kind == "last" else make_repeat_rows(args.count)
    args.path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
