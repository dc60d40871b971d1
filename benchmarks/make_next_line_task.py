"""Build the local lm-eval task `next_line` from the held-out corpus (`../shared/corpus/valid.jsonl`).

Each record is a few lines of a held-out document (the context) and four candidate next lines:
the true one and three taken from other documents, shuffled. A model that has learnt the
register of technical prose picks the true line far more often than 1 in 4; a pruned model's
accuracy against the dense model's shows what pruning cost on a downstream-style task, offline.

    .venv/bin/python benchmarks/make_next_line_task.py   # rewrites recipes/tasks/next_line/next_line.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if len(line.strip()) >= 20]


def build(corpus: Path, records: int, context_lines: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    documents = [_lines(json.loads(row)["text"]) for row in corpus.read_text().splitlines() if row.strip()]
    documents = [d for d in documents if len(d) > context_lines + 1]
    out: list[dict] = []
    for index in range(records):
        doc = index % len(documents)
        lines = documents[doc]
        start = rng.randrange(len(lines) - context_lines)
        context, answer = lines[start : start + context_lines], lines[start + context_lines]
        others = [d for i, d in enumerate(documents) if i != doc]
        distractors = [rng.choice(rng.choice(others)) for _ in range(3)]
        choices = [answer, *distractors]
        rng.shuffle(choices)
        out.append({"context": "\n".join(context) + "\n", "choices": choices, "label": choices.index(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus" / "valid.jsonl"))
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--context-lines", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "recipes" / "tasks" / "next_line" / "next_line.jsonl"))
    args = parser.parse_args()
    rows = build(Path(args.corpus), args.records, args.context_lines, args.seed)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} records to {args.out}")


if __name__ == "__main__":
    main()
