"""Compiled CPU kernels for decoding in fp32 (``eagle/runtime/csrc/cpu_kernels.cpp``): the few-row matrix
products (``stream_linear``; ``stream_linear_q`` reads a weight from its exact block encoding,
``eagle.runtime.block_codes``, with the same bits), Llama's RMSNorm (``rms_norm``), the gated MLP's activation
(``silu_mul``), and attention over the cache for a few rows (``rope_cache``: rotary queries and
keys, keys and values written into the cache buffers; ``attention``: grouped-query, masked or
causal, each row summed over its own keys in order so its result does not depend on the other rows
or on masked keys between its own), the KV cache's compaction to a verified tree's accepted path
in every layer at once (``compact_rows``, used by ``eagle.runtime.kv_cache.StaticCache``), and a model's
decoder layers run by one call a forward (``DecoderStack``: their weights handed over once, not
converted again at every call).

``cpu_kernels()`` builds them on first use with torch's C++ extension tools (a compiler and
ninja; once per machine and torch version, cached under ``$EAGLE_CACHE/extensions``)
on CPUs with AVX-512, and returns None elsewhere, when the build fails (the callers then use
oneDNN or ``F.linear``, and torch's operations), or when the environment variable
``EAGLE_CPU_KERNELS`` is ``0`` (read once per process: to compare, or to rule the kernels out when
debugging). ``eagle.runtime.decoder.PackedLinear`` uses ``stream_linear`` for 1-16 rows,
``eagle.runtime.decoder.LeanDecoder`` and ``eagle.drafting.drafter.LeanDrafter`` a ``DecoderStack`` (for one sequence
of 1-16 rows). Built with
``-ffp-contract=off``: a product and a sum stay two roundings, as in torch's operations, so the
rotary embedding gives torch's bits. Inference only: they have no backward."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings
import time
from pathlib import Path
from typing import Any, Callable

import torch

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
STREAM_MAX_ROWS = 16  # the kernel's row limit (kMaxRows)
NAME = "eagle_cpu_kernels"
StreamOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", bool], torch.Tensor]


def cpu_has_avx512() -> bool:
    """Whether torch's CPU dispatch found AVX-512 on this machine."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


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
    """The compiled module (``stream_linear``, ``rms_norm``), or None where it cannot run here
    (no AVX-512, no compiler or ninja) or is turned off (``EAGLE_CPU_KERNELS=0``)."""
    if os.environ.get("EAGLE_CPU_KERNELS", "1") == "0" or not cpu_has_avx512():
        return None
    if not _ninja_on_path():
        warnings.warn("eagle: ninja not found; the compiled fp32 kernels are off (pip install ninja)")
        return None
    from torch.utils import cpp_extension

    from eagle.cache_dir import cache_root

    build = cache_root() / "extensions" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    if clear_stale_lock(build):
        print(f"eagle: removed a stale build lock in {build} (left by a killed build)", file=sys.stderr)
    if not any(build.glob(f"{NAME}*.so")):
        print("eagle: compiling the fp32 CPU kernels (once per machine, about 25 s)", file=sys.stderr)
    try:
        return cpp_extension.load(name=NAME, sources=[str(SOURCE)], build_directory=str(build),
                                  extra_cflags=["-O3", "-mavx512f", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"],
                                  verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        warnings.warn(f"eagle: the fp32 CPU kernels did not build ({exc}); using oneDNN / F.linear")
        return None


@functools.cache
def source_digest() -> str:
    """A short hash of the kernels' source: timings measured with one version of them (the tree
    proposer's cached cost curves, ``eagle.decoding.tree_sizing``) do not hold for another."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


def attention_fits(head_dim: int) -> bool:
    """Whether the compiled attention (``rope_cache``, ``attention``, so ``decoder_layer``) takes
    this head dim: 32 to 128, a multiple of 32."""
    return head_dim % 32 == 0 and head_dim <= 128


def stream_linear_op() -> StreamOp | None:
    """``op(x [M, K], w [N, K], bias [N] | None, once=False) -> [M, N]`` for contiguous fp32 CPU
    tensors and 1 <= M <= 16 (``cpu_kernels().stream_linear``; ``once``: a weight read once per
    forward, fetched so as not to push reused data out of the caches), or None where the kernels
    cannot run here."""
    module = cpu_kernels()
    return None if module is None else module.stream_linear
