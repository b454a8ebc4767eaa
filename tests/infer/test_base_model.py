"""A base Gemma-3 target (no chat template) through eagle-generate and eagle-bench: plain prompts."""

import json

import pytest
from tokenizers import processors

from eagle.runtime.target import load_target
from infer import bench, cli

from tests.conftest import tiny_drafter, tiny_gemma


def with_bos(tokenizer, bos="t2"):
    """``tokenizer`` adding ``bos`` in front of every encoded text, as a base model's tokenizer does."""
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.bos_token = bos
    return tokenizer


@pytest.fixture(scope="module")
def saved_gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    target = tiny_gemma(window=4)
    target.model.save_pretrained(root / "target")
    with_bos(target.tokenizer).save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")


def test_a_plain_prompt_is_tokenized_as_is_with_the_bos_the_tokenizer_adds(saved_gemma):
    target = load_target(saved_gemma[0])
    assert not getattr(target.tokenizer, "chat_template", None)
    assert target.encode_prompt("t5 t6 t7") == [2, 5, 6, 7]
    assert type(target.lean).__name__ == "GemmaDecoder" and target.graphs is None


@pytest.mark.slow
def test_generate_and_bench_run_a_base_gemma_target(saved_gemma, tmp_path, capsys):
    target, drafter = saved_gemma
    assert cli.main(["--target", target, "--drafter", drafter, "--method", "eagle-tree", "--max-new-tokens", "12",
                     "t3 t4 t5 t3 t4"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["t3 t4 t5 t3 t4 t5", "t7 t8 t9 t10 t11 t7"]))
    report = tmp_path / "b.json"
    assert bench.main(["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--methods",
                       "hf,ar,pld,eagle-tree", "--max-new-tokens", "16", "--json", str(report)]) == 0
    methods = json.loads(report.read_text())["methods"]
    assert all(methods[m]["identical_to_ar"] for m in ("hf", "pld", "eagle-tree")), methods
    assert methods["eagle-tree"]["mean_accept_length"] >= 1
