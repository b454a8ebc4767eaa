"""The config keys of eagle-generate, eagle-bench and eagle-serve, one line each, as docs/options.md shows them."""

from __future__ import annotations

import dataclasses

from eagle.config import LoadOptions
from infer.bench import BenchOptions
from infer.serve import ServeOptions

KEY_HELP = {  # one line per config key for docs/options.md (the full contracts: the classes named there)
    "depth": "tree expansion steps after the root's children (default 6)",
    "top_k": "the tree's frontier nodes expanded per step and children per node (default 10; not sampling's --top-k)",
    "lookup_tokens": "prompt-lookup drafts grafted onto each tree; 0 off (default 10)",
    "sampled_tree": "when sampling, draw the tree's children from the drafter (default true); false: its top_k",
    "draw_temperature_scale": "drawn children's temperature, times the sampling temperature (default 0.85)",
    "draw_support": "drawn children among the drafter's this many likeliest tokens; 0: all (default 64)",
    "gamma": "sd: the most draft tokens a step (default 8)",
    "lenience": "sd: below 1 accepts more drafts (lossy); 1 exact (default)",
    "adaptive_gamma": "sd: adapt gamma to the acceptance rate (default false)",
    "draft_vocab": "sd: the draft model's head computes its N most frequent tokens, where a token-frequency "
                   "table for its tokenizer is known; 0: all (default 32768)",
    "draft_confidence": "sd: a chain stops after a draft token the draft model gives less than this probability "
                        "(default 0.8; 0: always gamma tokens)",
    "drafter_dtype": "what the drafter and sd's draft model compute in: auto, float32, bfloat16, float16",
    "drafter_quant": "the EAGLE drafter's weights as q8_0 or q4_1 blocks, computed in fp32; none; auto",
    "cuda_graphs": "the target and drafter on static shapes, replayed as CUDA graphs (default: on CUDA)",
    "device_rounds": "tree rounds drafted, verified and accepted on the device (default: on CUDA where the tree "
                     "options allow it: an integer total_tokens, lookup_tokens 0; true otherwise is an error)",
    "int8_activations": "the target's quantized products take int8 activations, as llama.cpp's (CPU, fp32; "
                        "default: on for GGUF files with k-quant matrices)",
    "suffix": "suffix drafts' knobs, a mapping of history_tokens, corpus_tokens, max_pattern, max_depth, "
              "max_spec_factor, min_token_prob, prior, max_nodes (eagle.config.SuffixConfig; docs/suffix.md)",
    "warmup": "bench: run every method on the first N prompts first, not counted; serve: decode a few tokens first",
    "requests_per_client": "load test: each level of N clients sends N * K requests (default: every prompt once)",
    "api_key": "bench: the Bearer token of the server at --url; serve: require it on /v1",
    "llama_cpp": "llama.cpp build folder for the llama.cpp methods (default $EAGLE_LLAMA_CPP)",
    "llama_cpp_draft": "the draft of llama.cpp-eagle3: a .gguf file or an EAGLE-3 folder (default: --drafter's)",
    "llama_cpp_draft_max": "the most tokens llama-server drafts a step in llama.cpp-draft and llama.cpp-eagle3 "
                           "(default: llama.cpp's)",
    "cache_pool": "with --max-batch above 1: the batch's caches as slots of one pool, the GPU layout (default false)",
    "max_queue": "requests that may wait for a place in the running batch; more get 429",
    "max_body_bytes": "larger request bodies get 413",
    "request_timeout_s": "a request's time limit in seconds from its arrival (default none)",
    "max_tokens": "max_tokens of a request that gives none (default: up to the context)",
    "served_model_name": "the model id /v1/models lists (default: the target's name)",
}


def config_key_table() -> str:
    """The config keys of eagle-generate, eagle-bench and eagle-serve as a Markdown table (docs/options.md
    holds it verbatim: ``python -c "from infer.config_keys import config_key_table; print(config_key_table())"``)."""
    rows = ["| commands | key | default | meaning |", "|---|---|---|---|"]
    for cls, commands in ((LoadOptions, "generate, bench, serve"), (BenchOptions, "bench"), (ServeOptions, "serve")):
        for f in dataclasses.fields(cls):
            default = "" if f.default is None else f"`{f.default}`".lower()
            rows.append(f"| {commands} | `{f.name}` | {default} | {KEY_HELP[f.name]} |")
            commands = ""
    return "\n".join(rows)
