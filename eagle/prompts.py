"""Prompt files (JSONL) shared by the benchmark and data generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle.errors import EagleError, read_text

NO_CATEGORY = "uncategorized"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a chat template; a base model's has none, and its turns are plain text."""
    return bool(getattr(tokenizer, "chat_template", None))


def read_prompts(path: str | Path) -> list[dict]:
    """A JSONL prompt file -> ``[{"prompt": str, "category": str}]``. Each line is
    ``{"prompt": str, "category"?: str}`` or MT-bench style ``{"turns": [str, ...], "category": str}``
    (the first turn is used). Blank lines are skipped; any other bad line is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"prompt file not found: {path}")
    prompts = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EagleError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise EagleError(f"{where}: expected a JSON object with 'prompt' or 'turns'")
        if "prompt" in item:
            prompt = item["prompt"]
        elif "turns" in item:
            turns = item["turns"]
            if not isinstance(turns, list) or not turns:
                raise EagleError(f"{where}: 'turns' must be a non-empty list of strings")
            prompt = turns[0]
        else:
            raise EagleError(f"{where}: expected a JSON object with 'prompt' or 'turns'")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EagleError(f"{where}: the prompt must be a non-empty string")
        category = item.get("category", NO_CATEGORY)
        if not isinstance(category, str) or not category:
            raise EagleError(f"{where}: 'category' must be a non-empty string")
        prompts.append({"prompt": prompt, "category": category})
    if not prompts:
        raise EagleError(f"no prompts in {path}")
    return prompts
