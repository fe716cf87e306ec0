"""What final.sums costs the end of a run and every reader of its files: save_final (model.pt,
config.json, tokenizer.json, ...) and verify_final, timed with and without the checksums in
alternating rounds, on a state dict of a preset's size (the `medium` model by default).

    python -m tools.bench_final_sums --model medium --rounds 3 --dir /tmp/bench
"""

import argparse
import os
import shutil
import time

import torch

from lib.checkpoints import files, finished_run, model_pt
from model import PRESETS, LlamaConfig, LlamaForPretraining


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="medium", choices=sorted(PRESETS), help="the preset")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating")
    p.add_argument("--dir", default="bench_final_sums", help="a folder to write into")
    args = p.parse_args()
    import datasets

    from data import get_tokenizer

    config = LlamaConfig.from_preset(args.model)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device="cpu")
    for t in model.state_dict().values():
        t.normal_()
    texts = {"text": ["def f(x):\n    return x + 1\n"] * 50}
    tokenizer = get_tokenizer(datasets.Dataset.from_dict(texts), 300, f"{args.dir}.cache")
    gb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    times = {"save": [], "save, no sums": [], "verify": [], "torch.load": []}
    real = (model_pt.atomic_save, files.write_sums, files.checksums)

    def unsummed(obj, path, write=torch.save, sums=False, beside=True):
        return real[0](obj, path, write)

    for i in range(args.rounds):
        for sums in (True, False)[:: 1 if i % 2 else -1]:  # alternating: which goes first too
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            if not sums:  # the save as it was before final.sums
                model_pt.atomic_save, files.write_sums = unsummed, lambda *a: None
                files.checksums = lambda *a: []
            start = time.perf_counter()
            model_pt.save_final(args.dir, model, config, tokenizer)
            times["save" if sums else "save, no sums"].append(time.perf_counter() - start)
            model_pt.atomic_save, files.write_sums, files.checksums = real
        model_pt.save_final(args.dir, model, config, tokenizer)
        start = time.perf_counter()  # what a reader pays besides: torch.load, every byte read
        torch.load(os.path.join(args.dir, "model.pt"), weights_only=True, mmap=False)
        times["torch.load"].append(time.perf_counter() - start)
        finished_run._verified.clear()
        start = time.perf_counter()
        finished_run.verify_final(args.dir)
        times["verify"].append(time.perf_counter() - start)
    print(f"{args.model}: model.pt {gb:.2f} GB; seconds, best of {args.rounds} (all):")
    for name, found in times.items():
        print(f"  {name:14} {min(found):6.2f}  ({', '.join(f'{t:.2f}' for t in found)})")
    shutil.rmtree(args.dir)
    shutil.rmtree(f"{args.dir}.cache")


if __name__ == "__main__":
    main()
