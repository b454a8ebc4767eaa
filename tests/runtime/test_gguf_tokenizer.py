"""The lean Gemma tokenizer read from a GGUF file against transformers' tokenizer of the same file: the same
ids for every text, the same text for every id sequence, streamed text included."""

import os
import random
from pathlib import Path

import pytest

from eagle.engine import RoundText
from eagle.runtime.gguf_file import read_header
from eagle.runtime.gguf_tokenizer import SentencePieceBPE, gguf_tokenizer

GEMMA_GGUF = Path(os.environ.get("EAGLE_GEMMA_GGUF", "/tmp/gemma/gemma-3-270m-q4_k_m.gguf"))
ALPHABET = ["a", "b", "c", "d", "\u2581", "é", "€", "<", ">"]
ADDED = ["[multimodal]", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n", "  ", "   "]


def tiny_vocabulary(seed: int = 0) -> tuple[list[str], list[int]]:
    """(tokens, GGUF token types) of a small Gemma-like vocabulary: control tokens, user-defined ones (two
    of spaces only, which transformers spells in "▁" and does not add), a token of a space and a newline
    (spelled "▁▁" too: a repeated token), the 256 byte tokens, and words over ``ALPHABET`` in random order."""
    rng = random.Random(seed)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + ADDED + [" \n"]
    types = [3] * 5 + [4, 3, 3, 4, 4, 4, 4, 1]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words: set[str] = set()
    while len(words) < 150:
        words.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 5))))
    normal = ALPHABET + sorted(words)
    rng.shuffle(normal)
    return tokens + normal, types + [1] * len(normal)


def write_tokenizer_gguf(path: Path, tokens: list[str], types: list[int], arch: str = "gemma3",
                         chat_template: str | None = None) -> Path:
    """A GGUF file with a SentencePiece vocabulary, Gemma's special token ids and a few hyperparameters."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_context_length(64)
    writer.add_head_count(2)
    writer.add_feed_forward_length(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(transformers' tokenizer, the lean one) of a tiny Gemma GGUF file."""
    from transformers import AutoTokenizer

    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", *tiny_vocabulary())
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), gguf_tokenizer(path)


def assert_same(reference, lean, texts, id_lists) -> None:
    """Encoding ``texts``, decoding ``id_lists`` (both ways of special tokens) and streaming them give the same."""
    for text in texts:
        assert lean(text)["input_ids"] == reference(text)["input_ids"], repr(text)
        assert lean.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(1)
    for ids in id_lists:
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids
        ours, theirs, start = RoundText(lean), RoundText(reference), 0
        while start < len(ids):  # rounds of 1-4 tokens, as a stream accepts them
            end = start + rng.randint(1, 4)
            assert ours.feed(ids[start:end]) == theirs.feed(ids[start:end]), ids
            start = end


def test_a_tiny_gemma_vocabulary_tokenizes_as_transformers(tiny_pair):
    """Random texts over the vocabulary's characters, spaces, runs of spaces and newlines, characters only
    byte tokens spell, and added tokens; random id sequences over the whole vocabulary (special, byte,
    repeated tokens); the vocabulary and special ids."""
    reference, lean = tiny_pair
    assert isinstance(lean, SentencePieceBPE) and lean.chat_template is None
    rng = random.Random(0)
    pieces = ALPHABET + [" ", " ", " ", "z", "😀", "\t", "<mask>", "<bos>", "\u00a0"] + ADDED
    texts = ["", " ", "  ", "abc", "<start_of_turn>a b<end_of_turn>"] + [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    ids = [[rng.randrange(len(lean)) for _ in range(rng.randint(0, 20))] for _ in range(300)]
    assert_same(reference, lean, texts, ids)
    assert lean.get_vocab() == reference.get_vocab()
    assert (lean.bos_token_id, lean.eos_token_id, lean.pad_token_id) == (2, 1, 0)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(lean, name) == getattr(reference, name)
    assert set(lean.all_special_ids) == set(reference.all_special_ids)
    assert lean.convert_ids_to_tokens([2, 300]) == reference.convert_ids_to_tokens([2, 300])


def test_merges_over_a_two_letter_alphabet_apply_in_transformers_order(tmp_path):
    """Every word of up to four letters over "a", "b" and "▁", in random order: texts of those letters overlap
    in many ways, so the order of merges making the same token from different parts (the longer left part
    first), and merges whose neighbours changed while they waited, decide the ids."""
    from transformers import AutoTokenizer

    rng = random.Random(3)
    words = sorted({"".join(rng.choice("ab▁") for _ in range(n)) for n in (2, 3, 4) for _ in range(200)})
    rng.shuffle(words)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a", "b", "▁"] + words
    types = [3] * 4 + [6] * 256 + [1] * (3 + len(words))
    path = write_tokenizer_gguf(tmp_path / "ab.gguf", tokens, types)
    reference, lean = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), gguf_tokenizer(path)
    texts = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 40))) for _ in range(300)]
    assert_same(reference, lean, texts, [])


def test_files_it_does_not_serve_get_transformers_tokenizer(tmp_path):
    """A vocabulary of another architecture gets no lean tokenizer."""
    tokens, types = tiny_vocabulary()
    assert gguf_tokenizer(write_tokenizer_gguf(tmp_path / "g.gguf", tokens, types)) is not None
    llama = write_tokenizer_gguf(tmp_path / "l.gguf", tokens, types, arch="llama")
    assert gguf_tokenizer(llama) is None and gguf_tokenizer(llama, read_header(llama)) is None


# Gemma's turn markup, whitespace control, a system turn folded into the first user turn, roles that must
# alternate (raise_exception), loop variables and filters: what an instruction-tuned Gemma file's template uses
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}{%- set prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}\n"
    "    {{ message['content'] | trim }}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n")


def test_a_chat_template_is_rendered_and_tokenized_as_transformers_does(tmp_path):
    """A file with a chat template keeps the lean tokenizer: every conversation rendered (with and without the
    generation prompt) to transformers' text and ids; a template's own error is raised as there."""
    from transformers import AutoTokenizer

    tokens, types = tiny_vocabulary()
    path = write_tokenizer_gguf(tmp_path / "it.gguf", tokens, types, chat_template=GEMMA_LIKE_TEMPLATE)
    reference, lean = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), gguf_tokenizer(path)
    assert isinstance(lean, SentencePieceBPE) and lean.chat_template == reference.chat_template
    assert gguf_tokenizer(path, read_header(path)) is not None
    rng = random.Random(4)
    words = ALPHABET + [" ", "  ", "\n", "é€", "<start_of_turn>", "<bos>", "😀"]

    def text() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))

    chats = [[{"role": "user", "content": "abc"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": " a b "}]]
    for _ in range(40):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": text()}
                 for i in range(2 * rng.randint(0, 2) + 1)]
        chats.append(([{"role": "system", "content": text()}] if rng.random() < 0.3 else []) + turns)
    for chat in chats:
        for prompt in (True, False):
            assert lean.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == \
                reference.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False), chat
            expected = reference.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
            expected = expected["input_ids"] if hasattr(expected, "keys") else expected
            assert lean.apply_chat_template(chat, add_generation_prompt=prompt) == list(expected), chat
    wrong = [{"role": "assistant", "content": "a"}]
    with pytest.raises(Exception, match="roles must alternate") as theirs:
        reference.apply_chat_template(wrong)
    with pytest.raises(theirs.type, match="roles must alternate"):
        lean.apply_chat_template(wrong)


def varied_texts(seed: int = 0, n: int = 300) -> list[str]:
    """Texts of many kinds: prose, code, numbers, whitespace runs, several scripts, emoji (joined ones
    too), characters only byte tokens spell, control characters, the file's special token strings."""
    fixed = ["The capital of France is", "", " ", "\n", "  leading spaces", "trailing   ", "tabs\tand\t\ttabs",
             "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
             "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; }",
             "1234567890 3.14159 -42 1e-9 0x1F 1,000,000.00 2026-11-27T05:30:00Z",
             "naïve café résumé Ångström façade", "日本語のテキストと漢字", "한국어 텍스트", "العربية والفارسية",
             "Русский текст, ёж", "ελληνικά", "हिन्दी पाठ", "ภาษาไทย", "emoji 😀🎉🏳️‍🌈👨‍👩‍👧 ❤️",
             "\U0001d518\U0001d51e\U00010348 \ue000\uf8ff \U000e0001", "\x00\x01\x7f\x1b[31m", "a\u200bb\u200dc\ufeff",
             "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad><mask><unk>",
             "<unused0><unused99>[multimodal]", "<start_of_image>", "▁already▁spelled▁", " \n \n\n  \n",
             "     five", "x" * 200, "ab" * 50, "\u2581 \u2581  ", "https://example.com/a?b=c&d=e#f",
             "\"quoted\" 'single'"]
    rng = random.Random(seed)
    parts = [t for t in fixed if t] + ["word", " ", "  ", "\n", "\n\n", ".", ",", "😀", "é", "中", "\t", "0", "42"]
    texts = list(fixed)
    while len(texts) < n:
        texts.append("".join(rng.choice(parts) for _ in range(rng.randint(1, 8))))
    return texts


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not GEMMA_GGUF.is_file(), reason=f"no Gemma GGUF file at {GEMMA_GGUF} (EAGLE_GEMMA_GGUF)")
def test_the_gemma3_vocabulary_tokenizes_as_transformers():
    """Gemma-3-270M's own file (262,144 tokens): a few hundred varied texts and random id sequences give
    what transformers' tokenizer of the file gives."""
    from transformers import AutoTokenizer

    from eagle.runtime.target import gguf_metadata_dir

    reference = AutoTokenizer.from_pretrained(gguf_metadata_dir(GEMMA_GGUF))
    lean = gguf_tokenizer(GEMMA_GGUF)
    rng = random.Random(0)
    texts = varied_texts()
    ids = [reference(t)["input_ids"] for t in texts[:50]]
    ids += [[rng.randrange(len(lean)) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    byte_ids = [lean.vocab[f"<0x{b:02X}>"] for b in range(256)]
    ids += [[rng.choice(byte_ids) for _ in range(rng.randint(1, 8))] for _ in range(50)]
    assert_same(reference, lean, texts, ids)
    assert lean.get_vocab() == reference.get_vocab()
