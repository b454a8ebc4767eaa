"""Memory and lookup cost of the suffix index (docs/suffix.md): the Python standard library's sources
tokenized by the default target's tokenizer (``read_corpus``, cached), repeated to each size, then
lookups of contexts cut from the held text (a match is found) and of random tokens (mostly none),
timed one by one as a decoding round makes them.

    EAGLE_CACHE=/work/cache python scripts/suffix_cost.py --sizes 1000000 10000000"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from eagle.config import SuffixConfig
from eagle.drafting.suffix import SEP, new_index, read_corpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--corpus", default="/usr/lib/python3.11")
    parser.add_argument("--lookups", type=int, default=2000)
    args = parser.parse_args()
    from eagle.runtime.target import load_target

    target = load_target("smollm2-135m-instruct")
    cfg = SuffixConfig()
    start = time.perf_counter()
    corpus, stats = read_corpus(args.corpus, target.tokenizer, target.tokenizer_fingerprint, cfg)
    print(f"corpus {args.corpus}: {stats['files']} files, skipped {stats['skipped']}, {stats['tokens']:,} tokens, "
          f"cached {stats['cached']}, {time.perf_counter() - start:.1f} s")
    flat = corpus.ring[:corpus.end].copy()
    rng = np.random.default_rng(0)
    for size in args.sizes:
        tokens = np.tile(flat, size // len(flat) + 1)[:size]
        index = new_index(size, cfg)
        start = time.perf_counter()
        index.add_separated(tokens)
        built = time.perf_counter() - start
        for kind in ("held", "random"):
            times, cpu, matched = [], [], 0
            for _ in range(args.lookups):
                if kind == "held":
                    at = int(rng.integers(64, size))
                    context = [t for t in tokens[at - 64:at].tolist() if t != SEP] or [0]
                else:
                    context = rng.integers(0, target.vocab_size, 64).tolist()
                t0, c0 = time.perf_counter(), time.thread_time()
                found = index.lookup(context, cfg.max_depth, cfg.min_token_prob, cfg.max_nodes, cfg.max_spec_factor)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                matched += bool(found.tokens)
            times.sort()
            cpu.sort()
            print(f"{size:>11,} tokens, {index.nbytes / 2 ** 20:7.1f} MiB, built in {built:5.1f} s; {kind:6} contexts: "
                  f"wall median {1e6 * statistics.median(times):5.0f} us, p99 {1e6 * times[int(0.99 * len(times))]:6.0f}"
                  f" us; CPU median {1e6 * statistics.median(cpu):5.0f} us, mean {1e6 * statistics.fmean(cpu):5.0f} us, "
                  f"p99 {1e6 * cpu[int(0.99 * len(cpu))]:5.0f} us; drafts in {matched / len(times):.0%}")


if __name__ == "__main__":
    main()
