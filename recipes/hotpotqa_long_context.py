"""HotpotQA as long-context retrieval-augmented GRPO data: the parquet files ``recipes/grpo_qwen3_rag_prefix.sh`` reads.

Each prompt is a multi-thousand-token block of documents (the question's own ten HotpotQA "distractor"
paragraphs, two of them the supporting ones, plus ``--extra-paragraphs`` more drawn from other questions)
followed by the question. The G responses of a GRPO group are short (an answer in ``<answer>...</answer>``), so
the prompt is most of every row's tokens: the regime where computing the prompt once per group pays
(docs/benchmarks.md: about 7x at prompt 2048 / response 128, about 1.2x at 256 / 1024).

The reward is verl's own exact match for HotpotQA (``data_source`` ``searchR1_hotpotqa``,
``verl.utils.reward_score.search_r1_like_qa_em``): 1 when the last ``<answer>`` matches the gold answer.

    pip install datasets   # on the machine that prepares the data; it downloads hotpotqa/hotpot_qa
    python recipes/hotpotqa_long_context.py --out ~/data/hotpotqa_long

Writes ``train.parquet`` (from HotpotQA's train split) and ``test.parquet`` (from its validation split) in
the layout verl's ``RLHFDataset`` reads, like verl's ``examples/data_preprocess`` scripts.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

DATA_SOURCE = "searchR1_hotpotqa"  # verl's default reward routes this data source to its HotpotQA exact match
SYSTEM = (
    "You answer questions from the documents you are given. Read every document, reason step by step about "
    "which ones answer the question (most are unrelated), then give the final answer, a short span such as a "
    "name, a date or yes/no, inside <answer> and </answer>."
)


def paragraphs(example: dict) -> list[tuple[str, str]]:
    """One HotpotQA example's ``(title, text)`` paragraphs, in the data set's order."""
    context = example["context"]
    return [(title, "".join(sentences)) for title, sentences in zip(context["title"], context["sentences"])]


def make_row(example: dict, split: str, index: int, extra: Sequence[tuple[str, str]] = (), seed: int = 0) -> dict:
    """The verl row for one example: its paragraphs and ``extra`` ones shuffled into one document block."""
    own = set(example["context"]["title"])
    docs = paragraphs(example) + [p for p in extra if p[0] not in own]
    random.Random(f"{seed}:{example['id']}").shuffle(docs)
    block = "\n\n".join(f"Document {i + 1} (title: {title}): {text}" for i, (title, text) in enumerate(docs))
    question = example["question"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{block}\n\nQuestion: {question}"},
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": [example["answer"]]}},
        "extra_info": {"split": split, "index": index, "id": example["id"], "documents": len(docs)},
    }


def make_rows(examples: Iterable[dict], split: str, extra_paragraphs: int, seed: int = 0) -> list[dict]:
    """Rows for a split; each draws ``extra_paragraphs`` distractors from the other examples' paragraphs."""
    examples = list(examples)
    pool = [p for example in examples for p in paragraphs(example)]
    rng = random.Random(seed)
    rows = []
    for index, example in enumerate(examples):
        own = set(example["context"]["title"])
        # drawn with room for the question's own paragraphs (at most ten), which are left out
        drawn = rng.sample(pool, min(extra_paragraphs + len(own), len(pool))) if extra_paragraphs else []
        extra = [p for p in drawn if p[0] not in own][:extra_paragraphs]
        rows.append(make_row(example, split, index, extra, seed))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="~/data/hotpotqa_long", help="where train.parquet and test.parquet go")
    parser.add_argument(
        "--extra-paragraphs",
        type=int,
        default=20,
        help="distractor paragraphs from other questions added to each prompt's ten (20: about 3-4K tokens)",
    )
    parser.add_argument("--train-size", type=int, default=20000, help="train rows (HotpotQA has ~90K)")
    parser.add_argument("--test-size", type=int, default=500, help="test rows, from the validation split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import datasets  # the preparing machine's; the training nodes read parquet only

    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for split, source, size in (("train", "train", args.train_size), ("test", "validation", args.test_size)):
        data = datasets.load_dataset("hotpotqa/hotpot_qa", "distractor", split=source)
        data = data.shuffle(seed=args.seed).select(range(min(size, len(data))))
        rows = make_rows(data, split, args.extra_paragraphs, args.seed)
        datasets.Dataset.from_list(rows).to_parquet(str(out / f"{split}.parquet"))
        print(f"{out / f'{split}.parquet'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
