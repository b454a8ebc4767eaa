"""New tokens/s of batched plain decoding (``eagle.decoding.batch.BatchDecoder``) on one target.

    python scripts/batch_speed.py --rows 256 --prompts 1024 --max-new-tokens 256   # a GPU
    python scripts/batch_speed.py --rows 8 --prompts 8 --max-new-tokens 64          # a CPU

Prompts: the chat-templated dev prompts, cycled. An untimed warm-up on the first 2 x rows prompts (CUDA
graphs are captured there; a shape it did not meet is captured in the timed run), then the timed run:
prints one JSON line (rows, prompts, new tokens, seconds, tokens/s, device, dtype). ``--temperature``
> 0 samples (top-p 0.95)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle.config import SamplingConfig
from eagle.decoding.batch import BatchDecoder, Request, request_seed
from eagle.prompts import read_prompts
from eagle.runtime.target import DEFAULT_TARGET, load_target


def timed_run(target, decoder: BatchDecoder, requests: list[Request]) -> tuple[int, float]:
    """(new tokens, seconds) of decoding ``requests``."""
    pending = list(reversed(requests))
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in decoder.stream(lambda: pending.pop() if pending else None))
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-file", default="benchmarks/prompts/dev.jsonl")
    args = parser.parse_args()
    target = load_target(args.target)
    texts = [p["prompt"] for p in read_prompts(args.prompt_file)]
    ids = [target.encode_prompt(texts[i % len(texts)]) for i in range(args.prompts)]
    requests = [Request(p, args.max_new_tokens, request_seed(0, i)) for i, p in enumerate(ids)]
    sampling = SamplingConfig(temperature=args.temperature, top_p=0.95 if args.temperature > 0 else 1.0)
    capacity = max(len(p) for p in ids) + args.max_new_tokens
    decoder = BatchDecoder(target, args.rows, capacity, sampling)
    timed_run(target, decoder, requests[:2 * args.rows])  # warm-up: captures the graphs of the shapes it meets
    tokens, seconds = timed_run(target, decoder, requests)
    print(json.dumps({"rows": args.rows, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                      "device": str(target.device), "dtype": str(target.dtype),
                      "temperature": args.temperature}))


if __name__ == "__main__":
    main()
