"""How fast the DataLoader delivers tokens from the data pipeline (data.py), with no training.

    python -m tools.bench_loader --bench
    python -m tools.bench_loader --bench --data 'corpus/*.jsonl' --data-mode pad --num-workers 2

It times each step of data.py (corpus, tokenizer, tokens, examples), then a shuffling
DataLoader over the examples, as the training scripts read them. tools/bench.py reports the same
loader speed beside each strategy's step time.
"""

import itertools
import time

import torch

import data
from lib import exits, flags


def benchmark_loader(
    dataset: data.PretrainingDataset,
    batch_size: int,
    num_workers: int = 0,
    num_batches: int = 50,
    pin_memory: bool = False,
) -> float:
    """Tokens per second (of x) that a shuffling DataLoader delivers from `dataset`."""
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,  # random access, as in training
        num_workers=num_workers,
        pin_memory=pin_memory,  # as the training scripts on GPU: page-locked, for async copies
        persistent_workers=num_workers > 0,
    )
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    next(batches)  # not timed: the first batch pays for starting the workers
    n_tokens, start = 0, time.perf_counter()
    for x, _ in itertools.islice(batches, num_batches):
        n_tokens += x.numel()
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = flags.ArgumentParser(description=__doc__.split("\n\n")[0])  # a bad flag: one line
    parser.add_argument("--bench", action="store_true", help="measure DataLoader tokens/s")
    parser.add_argument(
        "--data", default="stdlib", help="corpus: stdlib, file, glob, dir, hub name"
    )
    parser.add_argument(
        "--text-column", default="text", help="text column of json/parquet/hub data"
    )
    parser.add_argument(
        "--txt-split",
        choices=["auto", "paragraph", "line", "file"],
        default="auto",
        help=".txt documents: see docs/data.md",
    )
    parser.add_argument(
        "--seq-length", type=flags.number_arg(int, 1), default=256, help="tokens per example"
    )
    parser.add_argument(
        "--batch-size", type=flags.number_arg(int, 1), default=32, help="examples per batch"
    )
    parser.add_argument(
        "--num-workers",
        type=flags.number_arg(int, 0),
        default=0,
        help="DataLoader worker processes",
    )
    parser.add_argument(
        "--data-mode", choices=["pack", "pad"], default="pack", help="example layout"
    )
    parser.add_argument("--cache-dir", default=".cache", help="where datasets and tokenizers cache")
    parser.add_argument(
        "--vocab-size",
        type=flags.number_arg(int, flags.MIN_VOCAB_SIZE, flags.MAX_VOCAB_SIZE),
        default=4096,
        help="BPE vocabulary size",
    )
    args = parser.parse_args()
    if not args.bench:
        parser.error("nothing to do: pass --bench")

    start = time.perf_counter()
    corpus = data.load_corpus(args.data, args.text_column, args.cache_dir, args.txt_split)
    train, val = data.split_corpus(corpus)
    print(f"corpus: {len(train)} train + {len(val)} val docs in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    tokenizer = data.get_tokenizer(train, args.vocab_size, args.cache_dir)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    tokens = data.tokenize(train, tokenizer)
    print(f"tokenize: {len(tokens)} docs in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    dataset = data.PretrainingDataset(tokens, args.seq_length, args.data_mode)
    print(f"{args.data_mode}: {len(dataset)} examples in {time.perf_counter() - start:.1f}s")
    speed = benchmark_loader(dataset, args.batch_size, args.num_workers)
    print(f"DataLoader: {speed:,.0f} tokens/s")


if __name__ == "__main__":
    exits.run(main)  # bad input (a ValueError): one line, exit 2
