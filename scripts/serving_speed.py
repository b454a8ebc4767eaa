"""Aggregate new tokens/s of ``ServingEngine`` (continuous batching with draft trees) per method and
batch size, on one target.

    python scripts/serving_speed.py --methods ar,eagle-tree --batch 1,4,8 --prompts 8 --max-new-tokens 64

Prompts: the chat-templated dev prompts, cycled; all are queued at once and decoded ``--batch`` at a
time, greedy. The process's CPU time is reported beside the wall time (on a machine shared with
other work, wall time measures the others too; with OMP_NUM_THREADS=1 CPU time is the work done).
An untimed warm-up first (the cost curve is measured there if it is not cached). With ``--check``
each output is compared with the same prompt decoded alone (``ar``). Prints one JSON line per
(method, batch): new tokens, seconds, tokens/s, mean accepted length and tree size, identical
outputs. ``--cache-pool on|off`` chooses the engine's cache layout (default off: per-sequence caches;
on: pooled, the GPU layout). ``--count-ops N`` also counts the torch operations (each at least one kernel launch on a
GPU) of N rounds of a full batch, by phase of the round, with torch's dispatch mode: a machine-independent
measure of what launching costs on a GPU, where a 135M target's round is launch-bound."""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle import EagleModel
from eagle.decoding.serving import ServingEngine, RequestOptions
from eagle.prompts import read_prompts
from eagle.runtime.target import DEFAULT_TARGET


POOL = {"on": True, "off": False}


class OpCounter(TorchDispatchMode):
    """Counts the torch operations run inside it that compute or copy (views and metadata excluded:
    they launch nothing), under the phase last named (``phase``); ``names`` by operation."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.count, self.names = "other", collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if not func.is_view and func.overloadpacket not in METADATA:
            self.count[self.phase] += 1
            self.names[(self.phase, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


METADATA = {torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense}


def count_ops(model: EagleModel, prompts: list[list[int]], method: str, batch: int, rounds: int,
              cache_pool: bool) -> dict:
    """The torch operations of ``rounds`` rounds of ``batch`` running sequences (after two rounds
    uncounted), per round and by phase: propose (drafting), verify (the target forward), finish
    (acceptance, compaction, the proposer's update, the greedy head)."""
    engine = ServingEngine(model, max_batch=batch, load_sizing=False, cache_pool=cache_pool)
    for i, ids in enumerate(prompts[:batch]):
        engine.add(i, ids, RequestOptions(method=method, max_new_tokens=rounds + 8))
    engine.step()
    engine.step()
    counter = OpCounter()
    phases = {"_propose": "propose", "_verify": "verify", "_greedy_choices": "finish", "_finish_round": "finish"}
    for name, phase in phases.items():
        def phased(*args, _run=getattr(engine, name), _phase=phase, **kwargs):
            counter.phase = _phase
            try:
                return _run(*args, **kwargs)
            finally:
                counter.phase = "other"
        setattr(engine, name, phased)
    with counter:
        for _ in range(rounds):
            engine.step()
    return {"method": method, "batch": batch, "cache_pool": engine._pool is not None, "rounds": rounds,
            "ops_per_round": round(sum(counter.count.values()) / rounds, 1),
            **{f"{k}_ops_per_round": round(v / rounds, 1) for k, v in sorted(counter.count.items())}}


def run(model: EagleModel, prompts: list[list[int]], method: str, batch: int, max_new_tokens: int,
        load_sizing: bool, cache_pool: bool = False) -> dict:
    """Decode ``prompts`` ``batch`` at a time -> tokens per prompt, seconds, rounds' accepted lengths and tree sizes."""
    engine = ServingEngine(model, max_batch=batch, load_sizing=load_sizing, cache_pool=cache_pool)
    for i, ids in enumerate(prompts):
        engine.add(i, ids, RequestOptions(method=method, max_new_tokens=max_new_tokens))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    accepted, trees, start, cpu = [], [], time.perf_counter(), time.process_time()
    while engine.active or engine.queued:
        for event in engine.step():
            tokens[event.request_id].extend(event.new_token_ids)
            accepted.append(len(event.new_token_ids))
            trees.append(event.stats.tree_size)
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "accepted": accepted, "trees": trees}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--methods", default="ar,eagle-tree")
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-file", default="benchmarks/prompts/dev.jsonl")
    parser.add_argument("--fixed-trees", action="store_true", help="the configured trees, not sized from the load")
    parser.add_argument("--check", action="store_true", help="compare each output with the prompt decoded alone")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--cache-pool", choices=sorted(POOL), default="off")
    parser.add_argument("--count-ops", type=int, default=0, metavar="ROUNDS",
                        help="count the torch operations of this many rounds of a full batch, not timed")
    args = parser.parse_args()
    model = EagleModel.from_pretrained(args.target, device=args.device,
                                       dtype=getattr(torch, args.dtype) if args.dtype else None)
    pool = POOL[args.cache_pool]
    texts = [p["prompt"] for p in read_prompts(args.prompt_file)]
    prompts = [model.target.encode_prompt(texts[i % len(texts)]) for i in range(args.prompts)]
    alone = [model.generate(p, max_new_tokens=args.max_new_tokens).token_ids for p in prompts] if args.check else None
    methods, batches = args.methods.split(","), [int(b) for b in args.batch.split(",")]
    if args.count_ops:
        for batch in batches:
            for method in methods:
                print(json.dumps(count_ops(model, prompts, method, batch, args.count_ops, pool)), flush=True)
        return
    for method in methods:  # warm-up: kernels, the cost curve, each method's first rounds
        run(model, prompts[:2], method, 2, 8, not args.fixed_trees, pool)
    for batch in batches:
        for method in methods:
            out = run(model, prompts, method, batch, args.max_new_tokens, not args.fixed_trees, pool)
            new = sum(len(t) for t in out["tokens"].values())
            print(json.dumps({
                "method": method, "batch": batch, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                "new_tokens": new, "seconds": round(out["seconds"], 2), "tokens_per_s": round(new / out["seconds"], 1),
                "cpu_seconds": round(out["cpu_seconds"], 2), "tokens_per_cpu_s": round(new / out["cpu_seconds"], 1),
                "mean_accepted": round(sum(out["accepted"]) / len(out["accepted"]), 2),
                "mean_tree": round(sum(out["trees"]) / len(out["trees"]), 2), "load_sizing": not args.fixed_trees,
                "identical": None if alone is None else sum(out["tokens"][i] == a for i, a in enumerate(alone))}),
                flush=True)


if __name__ == "__main__":
    main()
