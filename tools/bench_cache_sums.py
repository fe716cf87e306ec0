"""What checking the --cache-dir costs a start: a tokens cache of --tokens int32 tokens (random
ids, 256 per document) and its packed windows, as the data pipeline caches them, checked by their
checksums (files.verify_sums, what every start does before it opens them) against opening them
(datasets maps the files; count_tokens reads the offsets; one batch of windows is read).

    python -m tools.bench_cache_sums --tokens 76800000 --rounds 3 --dir /tmp/bench_cache
"""

import argparse
import os
import shutil
import time

import numpy as np

import data
from lib.checkpoints import files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=76_800_000, help="tokens in the cache")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each")
    p.add_argument("--dir", default="bench_cache_sums", help="a new folder to write into")
    args = p.parse_args()
    import datasets
    import pyarrow as pa

    datasets.disable_progress_bars()
    docs, length = max(1, args.tokens // 256), 256
    ids = np.random.default_rng(0).integers(0, 32000, docs * length, dtype=np.int32)
    offsets = pa.array(np.arange(0, docs * length + 1, length, dtype=np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids))})
    datasets.Dataset(table).save_to_disk(args.dir)  # an Arrow file, as datasets caches one
    [tokens] = [os.path.join(args.dir, n) for n in os.listdir(args.dir) if n.endswith(".arrow")]
    files.write_sums({os.path.basename(tokens): files.checksums(tokens)}, f"{tokens}{files.SUMS}")
    made = data.PretrainingDataset(datasets.Dataset.from_file(tokens), 1024)  # summed as made
    [windows] = {f["filename"] for f in made.rows.cache_files}
    size = sum(os.path.getsize(path) for path in (tokens, windows))
    times = {"verify": [], "open": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        for path in (tokens, windows):
            files.verify_sums(f"{path}{files.SUMS}")
        times["verify"].append(time.perf_counter() - start)
        start = time.perf_counter()
        n = data.count_tokens(datasets.Dataset.from_file(tokens))
        datasets.Dataset.from_file(windows).with_format("numpy")[:8]
        times["open"].append(time.perf_counter() - start)
    print(f"{n:,} tokens and their windows: {size / 1e6:,.0f} MB; seconds, best of {args.rounds}:")
    for name, found in times.items():
        print(f"  {name:7} {min(found):6.3f}  ({', '.join(f'{t:.3f}' for t in found)})")
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
