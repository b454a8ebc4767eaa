"""New tokens/s of batched plain decoding (``train.generation.BatchDecoder``, what training-data
generation runs) on one target.

    python scripts/data_generation_speed.py --rows 256 --prompts 1024 --max-new-tokens 256   # a GPU
    python scripts/data_generation_speed.py --rows 8 --prompts 8 --max-new-tokens 64          # a CPU
    python scripts/data_generation_speed.py --random-weights --prompt-lengths 64:1536 --rows 256 --prompts 512

``--random-weights``: no target file, random weights in SmolLM2-135M's architecture and prompts of
random ids (lengths drawn from ``--prompt-lengths``): speed only (rows rarely end early), e.g. to
compare ``--attention sdpa`` and ``varlen`` where the target cannot travel. ``--profile TOP`` then
prints torch.profiler's TOP operations of one prefill of the rows and 8 decode steps.

Prompts: the chat-templated dev prompts, cycled. An untimed warm-up on the first 2 x rows prompts (CUDA
graphs are captured there; a shape it did not meet is captured in the timed run), then the timed run:
prints one JSON line (rows, prompts, new tokens, seconds, tokens/s, device, dtype). ``--temperature``
> 0 samples (top-p 0.95)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from eagle.config import SamplingConfig
from train.generation import ATTENTION, BatchDecoder, BatchStats, Request, request_seed
from eagle.prompts import read_prompts
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target
from eagle.runtime.target import random_target as runtime_random_target

SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
           "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
           "eos_token_id": 2}


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
    parser.add_argument("--attention", default="auto", choices=ATTENTION)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the device's)")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2-135M's architecture, random weights")
    parser.add_argument("--prompt-lengths", default="64:1536", help="LO:HI prompt tokens with --random-weights")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="then profile one prefill of the rows and 8 steps, printing the TOP operations")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.random_weights:
        target = random_target(dtype)
        lo, hi = map(int, args.prompt_lengths.split(":"))
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(lo, hi + 1, (args.prompts,), generator=gen).tolist()
        ids = [torch.randint(3, target.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    else:
        target = load_target(args.target, dtype=dtype)
        texts = [p["prompt"] for p in read_prompts(args.prompt_file)]
        ids = [target.encode_prompt(texts[i % len(texts)]) for i in range(args.prompts)]
    requests = [Request(p, args.max_new_tokens, request_seed(0, i)) for i, p in enumerate(ids)]
    sampling = SamplingConfig(temperature=args.temperature, top_p=0.95 if args.temperature > 0 else 1.0)
    capacity = max(len(p) for p in ids) + args.max_new_tokens
    decoder = BatchDecoder(target, args.rows, capacity, sampling, attention=args.attention)
    timed_run(target, decoder, requests[:2 * args.rows])  # warm-up: captures the graphs of the shapes it meets
    decoder.stats = BatchStats(attention=decoder.stats.attention)
    tokens, seconds = timed_run(target, decoder, requests)
    print(json.dumps({"rows": args.rows, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                      "device": str(target.device), "dtype": str(target.dtype), "random_weights": args.random_weights,
                      "temperature": args.temperature, **dataclasses.asdict(decoder.stats)}))
    if args.profile:
        profile(target, decoder, requests[:args.rows], args.profile)


def profile(target: Target, decoder: BatchDecoder, requests: list[Request], top: int) -> None:
    """torch.profiler over the first rows' prefill and 8 decode steps: the ``top`` operations by
    device time (CPU time on a CPU), printed after the JSON line."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    pending = list(reversed([dataclasses.replace(r, max_new_tokens=8) for r in requests]))
    with torch_profile(activities=activities) as prof:
        for _ in decoder.stream(lambda: pending.pop() if pending else None):
            pass
        if target.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if target.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top))


def random_target(dtype: torch.dtype | None) -> Target:
    """Random weights in SmolLM2-135M-Instruct's architecture, with the lean forward, on the default
    device (CUDA when present)."""
    return runtime_random_target(dict(SMOLLM2, model_type="llama"), "random-smollm2-135m", dtype=dtype)


if __name__ == "__main__":
    main()
