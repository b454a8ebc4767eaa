"""Compiled CPU kernels for decoding in fp32 (``eagle/runtime/csrc/cpu_kernels.cpp``): the few-row matrix
products (``stream_linear``; ``stream_linear_q`` reads a weight from its exact block encoding,
``eagle.runtime.quant_blocks``, with the same bits), Llama's RMSNorm (``rms_norm``), the gated MLP's activation
(``silu_mul``), and attention over the cache for a few rows (``rope_cache``: rotary queries and
keys, keys and values written into the cache buffers; ``attention``: grouped-query, masked or
causal, each row summed over its own keys in order so its result does not depend on the other rows
or on masked keys between its own), the KV cache's compaction to a verified tree's accepted path
in every layer at once (``compact_rows``, used by ``eagle.runtime.kv_cache.StaticCache``), torch's argmax of
each row of logits, vectorized (``argmax_rows``), and a model's decoder layers run by one call a forward
(``DecoderStack``; ``GemmaStack`` for Gemma-3: their weights handed over once, not converted again at every
call).

``cpu_kernels()`` builds them on first use with torch's C++ extension tools (a compiler and
ninja; once per machine, torch version and instruction set, cached under ``$EAGLE_CACHE/extensions``)
for the best instruction set this CPU has (``ISAS``: ``avx512vnni``, AVX-512 whose int8 products take
VNNI's one-instruction dot products, the same integers; ``avx512``; ``avx2`` with FMA and F16C; or
``portable``: plain C++ that the compiler vectorizes for any CPU), and returns None when the build
fails (the callers then use oneDNN or ``F.linear``, and torch's operations) or when the environment
variable ``EAGLE_CPU_KERNELS`` is ``0``. ``EAGLE_CPU_ISA`` picks a lower one (``avx2`` on an AVX-512
CPU runs as a CPU without AVX-512 would); both are read once per process (to compare, or to rule the
kernels out when debugging). AVX2 computes AVX-512's bits; the portable path rounds a multiply-add
twice, so its bits differ from theirs, but on every path a row's result does not depend on the rows
computed with it. ``stream_linear_q`` and ``stream_linear_gguf_parts`` take ``int8=True`` (the AVX builds; the
module's ``int8_activations`` says whether it has them): x quantized to int8 per block of 32 (per super-block of
256 for Q4_K, Q5_K and Q6_K, ggml's Q8_K; those also on the portable build, by plain loops) meets the codes in
integers, as llama.cpp's products do, with other bits than the fp32 product but still row-independent
(``load_target(..., int8_activations=True)``). ``eagle.runtime.decoder.PackedLinear`` uses ``stream_linear`` for
1-16 rows, ``eagle.runtime.decoder.LeanDecoder`` and ``eagle.drafting.drafter.LeanDrafter`` a ``DecoderStack`` (for
one sequence of 1-16 rows). Built with
``-ffp-contract=off``: a product and a sum stay two roundings, as in torch's operations, so the
rotary embedding gives torch's bits. Inference only: they have no backward."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
import warnings
import time
from pathlib import Path
from typing import Any, Callable

import torch

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
STREAM_MAX_ROWS = 16  # the kernel's row limit (kMaxRows)

NAME = "eagle_cpu_kernels"
StreamOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", bool], torch.Tensor]


ISAS = ("avx512vnni", "avx512", "avx2", "portable")  # best first
ISA_FLAGS = {"avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c",
                            "-DEAGLE_ISA_AVX512", "-DEAGLE_VNNI"],
             "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-DEAGLE_ISA_AVX512"],
             "avx2": ["-mavx2", "-mfma", "-mf16c", "-DEAGLE_ISA_AVX2"],
             "portable": []}
ISA_ENV = "EAGLE_CPU_ISA"


def runs_stack(rows: int, masked: bool) -> bool:
    """Whether one sequence's ``rows`` new rows go through a compiled decoder stack: up to ``STREAM_MAX_ROWS``
    always, any number under a mask (a draft tree's, whose rows then get the bits each has alone: the products
    take them 16 at a time); a longer causal run (a prompt) takes torch's products, faster there."""
    return rows > 0 and (rows <= STREAM_MAX_ROWS or masked)


def cpu_has_avx512() -> bool:
    """Whether torch's CPU dispatch found AVX-512 on this machine."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


@functools.cache
def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (and AVX512-VL): its flags in ``/proc/cpuinfo`` (Linux; elsewhere
    False: the plain AVX-512 build runs there)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512_vnni", "avx512vl"} <= flags


def cpu_isas() -> tuple[str, ...]:
    """The kernels' instruction sets this CPU runs, best first (torch's CPU dispatch decides: AVX2 there
    implies FMA and F16C; VNNI from ``cpu_has_vnni``)."""
    capability = torch.backends.cpu.get_cpu_capability()
    found = ["avx512vnni"] if "AVX512" in capability and cpu_has_vnni() else []
    found += ["avx512"] if "AVX512" in capability else []
    found += ["avx2"] if "AVX512" in capability or "AVX2" in capability else []
    return tuple(found) + ("portable",)


def chosen_isa() -> str:
    """The instruction set ``cpu_kernels()`` builds for: ``$EAGLE_CPU_ISA`` if this CPU runs it, else the best."""
    wanted, have = os.environ.get(ISA_ENV, ""), cpu_isas()
    if not wanted:
        return have[0]
    if wanted not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, got {wanted!r}")
    if wanted not in have:
        raise ValueError(f"{ISA_ENV}={wanted}: this CPU runs only {', '.join(have)}")
    return wanted


def _ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` package's copy is added when missing."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


STALE_LOCK_S = 600.0  # a build takes 25 s to a few minutes; a lock older than this was left by a killed one


def clear_stale_lock(build: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build/lock`` when it is older than ``max_age_s``: torch's builder leaves it behind when
    killed mid-build, and every later load would wait for it forever. True when one was removed."""
    lock = build / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            return True
    except OSError:  # no lock, or another process removed it first
        pass
    return False


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled module for ``chosen_isa()`` (``stream_linear``, ``rms_norm``, ...; its ``isa`` names
    the instruction set), or None where it cannot run here (no compiler or ninja) or is turned off
    (``EAGLE_CPU_KERNELS=0``)."""
    if os.environ.get("EAGLE_CPU_KERNELS", "1") == "0":
        return None
    return kernels_for(chosen_isa())


_BUILD = threading.Lock()  # one build or load at a time (``build_in_background``'s thread and a caller)


def kernels_for(isa: str) -> Any | None:
    """The compiled module for one instruction set of ``cpu_isas()`` (tests run every one this CPU has),
    or None when it does not build here; a call while another thread builds it waits for that build."""
    with _BUILD:
        return _kernels_for(isa)


def build_in_background() -> None:
    """Build (or load) ``cpu_kernels()`` on a daemon thread: a first run compiles them (a minute) while it
    assembles and reads a GGUF file; the first caller that needs them waits for the build."""
    threading.Thread(target=cpu_kernels, name="eagle-kernel-build", daemon=True).start()


@functools.cache
def _kernels_for(isa: str) -> Any | None:
    if isa not in cpu_isas():
        raise ValueError(f"this CPU does not run the {isa} kernels (it runs {', '.join(cpu_isas())})")
    if not _ninja_on_path():
        warnings.warn("eagle: ninja not found; the compiled fp32 kernels are off (pip install ninja)")
        return None
    from torch.utils import cpp_extension

    from eagle.cache_dir import cache_root

    build = cache_root() / "extensions" / f"torch-{torch.__version__}" / isa
    build.mkdir(parents=True, exist_ok=True)
    if clear_stale_lock(build):
        print(f"eagle: removed a stale build lock in {build} (left by a killed build)", file=sys.stderr)
    name = f"{NAME}_{isa}"
    if not any(build.glob(f"{name}*.so")):
        print(f"eagle: compiling the fp32 CPU kernels for {isa} (once per machine, about 25 s)", file=sys.stderr)
    try:
        return cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                                  extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"] + ISA_FLAGS[isa],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        warnings.warn(f"eagle: the fp32 CPU kernels ({isa}) did not build ({exc}); using oneDNN / F.linear")
        return None


def source_digest() -> str:
    """A short hash of the kernels' source and instruction set: timings measured with one version of
    them (the tree proposer's cached cost curves, ``eagle.decoding.tree_sizing``) do not hold for
    another."""
    return hashlib.sha256(_source_bytes() + chosen_isa().encode()).hexdigest()[:8]


@functools.cache
def _source_bytes() -> bytes:
    return SOURCE.read_bytes()


def attention_fits(head_dim: int) -> bool:
    """Whether the compiled attention (``rope_cache``, ``attention``, so ``decoder_layer``) takes
    this head dim: 32 to 128, a multiple of 32."""
    return head_dim % 32 == 0 and head_dim <= 128


def attention_takes(head_dim: int) -> bool:
    """Whether the compiled ``attention`` alone takes this head dim: up to 256, a multiple of 16 (of them,
    1-8, 12 and 16 vectors of 16)."""
    return head_dim % 16 == 0 and 0 < head_dim // 16 <= 8 or head_dim in (192, 256)


def stream_linear_op() -> StreamOp | None:
    """``op(x [M, K], w [N, K], bias [N] | None, once=False) -> [M, N]`` for contiguous fp32 CPU
    tensors and 1 <= M <= 16 (``cpu_kernels().stream_linear``; ``once``: a weight read once per
    forward, fetched so as not to push reused data out of the caches), or None where the kernels
    cannot run here."""
    module = cpu_kernels()
    return None if module is None else module.stream_linear
