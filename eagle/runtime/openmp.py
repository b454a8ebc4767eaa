"""The OpenMP runtime under torch's CPU parallelism, where decoding moves to another thread.

libgomp keeps a pool of worker threads for each thread that has run a parallel region, and once its
pools hold more threads than there are cores it stops spinning between regions: every region then
waits for its workers to wake. A server loads the model on one thread and decodes on another (its
scheduler), so after the first thread's pool exists every parallel region of the decoding thread pays
that wake-up: on 2 cores a Gemma-3-270M token took 38-43 ms on the second thread against 22 ms on the
first (docs/serving.md). ``release_workers`` frees the calling thread's pool."""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads stopped, state kept


@functools.lru_cache(maxsize=1)
def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """The OpenMP runtimes loaded in this process (libgomp, libomp, libiomp) that have
    ``omp_pause_resource_all`` (OpenMP 5.0), found by their paths in the process's mappings."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {fields[5].strip() for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
    except OSError:  # not Linux
        return ()
    found = []
    for path in sorted(p for p in paths if any(n in p.rsplit("/", 1)[-1] for n in ("libgomp", "libomp", "libiomp"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            continue
        found.append(lib)
    return tuple(found)


def release_workers() -> bool:
    """Free the OpenMP worker threads kept for the calling thread's parallel regions (they are made
    again if it runs one). Called by a thread that hands decoding to another. Returns whether an
    OpenMP runtime took the call."""
    return any([lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0 for lib in _runtimes()])
