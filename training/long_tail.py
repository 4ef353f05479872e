"""A long-tailed length mix, reproducible by seed: most samples end early, a
few run long, as reasoning and agent rollouts do. Each row carries its own
`max_tokens` (read per prompt by both generation tasks) and the run samples
with `ignore_eos`, so every sample runs exactly its row's length whatever
the weights: the mix does not drift as the policy learns.

Full scale (GPU): `tail` = 5% of the rows run to 8192 tokens, the others
end within 512 (uniform in [64, 512]). `scale` divides every length (CPU:
scale 16 gives 4-32 and 512).

    python -m training.long_tail data/long_tail.jsonl --rows 64 --scale 16

Rows: `{"id", "prompt", "max_tokens", "answer"}`; the reward is
`training.rewards:target_chars_fraction` (lowercase letters per token), so
every group keeps a learning signal.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

#: Full-scale lengths: the short samples' range and the tail's length.
SHORT_TOKENS = (64, 512)
LONG_TOKENS = 8192
TAIL_FRACTION = 0.05


def make_rows(
    count: int, seed: int = 0, scale: int = 1, tail: float = TAIL_FRACTION
) -> list[dict[str, object]]:
    """`count` rows; round(count * tail) of them (at least one) are long,
    at places drawn from `seed`."""
    if count < 1 or scale < 1 or not 0.0 < tail < 1.0:
        raise ValueError(f"need count >= 1, scale >= 1, 0 < tail < 1; got {count}, {scale}, {tail}")
    rng = random.Random(seed)
    long_rows = set(rng.sample(range(count), max(1, round(count * tail))))
    low, high = (max(1, n // scale) for n in SHORT_TOKENS)
    long = max(1, LONG_TOKENS // scale)
    rows = []
    for i in range(count):
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        rows.append(
            {
                "id": f"long-tail-{i:04d}",
                "prompt": f"Write lowercase letters after {letters}",
                "max_tokens": long if i in long_rows else rng.randint(low, high),
                "answer": letters,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the long-tail workload as JSONL")
    parser.add_argument("path", type=Path)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=1, help="divide every length by this")
    args = parser.parse_args(argv)
    rows = make_rows(args.rows, args.seed, args.scale)
    args.path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
