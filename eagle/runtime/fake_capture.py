"""A CPU stand-in for CUDA graph capture: it refuses what a real capture refuses, and replays
the recorded operations without running the Python code again.

On a CPU the static path (``eagle.runtime.cuda_graphs``) runs eagerly, so nothing there shows
whether a static function could be captured on a GPU. ``fake_capture`` (installed with
``cuda_graphs.capture_with(fake_capture)``) runs the function once under ``HostCheck``, which
raises ``HostAccessError`` on what CUDA capture fails on or silently breaks:

- a tensor made from host data: ``torch.tensor``/``torch.as_tensor`` of Python values (a copy
  from pageable host memory), including the scalar an indexed assignment ``x[i] = 1.0`` makes,
  unless it only reaches an elementwise operation or a fill (CUDA passes such scalars by value);
- a read back to the host: ``.item()``, ``int()``/``float()``/``bool()`` of a tensor, ``.tolist()``,
  ``.numpy()``, and operations whose output size depends on the data (``nonzero``, boolean
  indexing, ``unique``, ``masked_select``, ``repeat_interleave`` by a tensor without ``output_size``).

The recorded operations are the graph: ``FakeGraph.replay`` runs them again on the static inputs'
current values and writes the results into the captured outputs, as a CUDA graph replay does (so
state the Python code keeps on the host is not updated by a replay, as on a GPU). What it cannot
see: a tensor created on the host before the capture and copied in during it."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# operations that wait for the device (a value read back, or an output size that depends on the data)
SYNCING = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                     "aten.nonzero_static.default", "aten.equal.default", "aten.masked_select.default",
                     "aten.unique_consecutive.default", "aten._unique2.default", "aten.unique_dim.default",
                     "aten.allclose.default", "aten.is_nonzero.default"})
MADE_FROM_HOST = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})
# what a host scalar may reach under CUDA capture besides elementwise operations: fills (by value) and aliases
SCALAR_OK = frozenset({"aten.fill_.Tensor", "aten.fill.Tensor", "aten.masked_fill_.Tensor", "aten.masked_fill.Tensor",
                       "aten.detach_.default", "aten.detach.default", "aten.alias.default"})


class HostAccessError(RuntimeError):
    """An operation inside a captured function that CUDA graph capture cannot record."""


def syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` on these arguments makes the host wait for the device."""
    name = str(func)
    if name in SYNCING:
        return True
    if name.startswith(("aten.index.", "aten.index_put", "aten._index_put_impl_")) and len(args) > 1 and isinstance(
            args[1], (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "aten.repeat_interleave.Tensor" or name == "aten.repeat_interleave.self_Tensor":
        return kwargs.get("output_size") is None
    return False


class HostCheck(TorchDispatchMode):
    """Records every operation run under it and raises ``HostAccessError`` on host data and host
    reads (see the module's docstring). ``ops``: (func, args, kwargs, output) in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.host: dict[int, torch.Tensor] = {}  # scalars made from host data, by id (kept alive)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if syncs(func, args, kwargs):
            raise HostAccessError(f"{name} reads the device back to the host inside a captured function")
        if name in MADE_FROM_HOST and args[0].dim() > 0:
            raise HostAccessError(f"a tensor of shape {tuple(args[0].shape)} made from host data (torch.tensor, "
                                  f"torch.as_tensor) inside a captured function")
        if name not in SCALAR_OK and torch.Tag.pointwise not in func.tags:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and id(t) in self.host:
                    raise HostAccessError(f"a host scalar (torch.tensor of a Python number, or x[i] = number) reaches "
                                          f"{name} inside a captured function: CUDA copies it from pageable memory")
        out = func(*args, **kwargs)
        if name in MADE_FROM_HOST or (name in SCALAR_OK and args and id(args[0]) in self.host):
            self.host[id(out)] = out
        self.ops.append((func, args, kwargs, out))
        return out


def _no_host_read(name: str) -> Callable:
    def refuse(self, *args, **kwargs):
        raise HostAccessError(f"Tensor.{name}() reads the device back to the host inside a captured function")

    return refuse


class FakeGraph:
    """The operations a ``HostCheck`` recorded and the function's output; ``replay`` runs them again.
    Made once: each operation's flattened arguments, with the slots of those an earlier operation
    produced (the rest, weights, static inputs, caches and host scalars, are the same objects)."""

    def __init__(self, ops: list, output: Any) -> None:
        slot_of: dict[int, int] = {}  # id of a tensor an operation produced -> its latest slot
        outs_made: list[torch.Tensor] = []
        self.steps = []
        for func, args, kwargs, out in ops:
            leaves, spec = tree_flatten((args, kwargs))
            fed = [(i, slot_of[id(x)]) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and id(x) in slot_of]
            outs = []
            for x in tree_flatten(out)[0]:
                outs.append(len(outs_made) if isinstance(x, torch.Tensor) else None)
                if isinstance(x, torch.Tensor):  # an in-place operation's output: a new slot for the same tensor
                    slot_of[id(x)] = len(outs_made)
                    outs_made.append(x)
            self.steps.append((func, leaves, spec if fed else (args, kwargs), fed, outs))
        self.slots = len(outs_made)
        self.outputs = [(x, slot_of.get(id(x))) for x in tree_flatten(output)[0]]
        self._keep = ops  # the recorded tensors stay alive: the outputs and the ids above refer to them

    def replay(self) -> None:
        """Run the recorded operations on this replay's intermediate results, then copy the results
        into the captured output tensors."""
        now: list[Any] = [None] * self.slots
        with torch.inference_mode():
            for func, leaves, spec, fed, outs in self.steps:
                if fed:
                    leaves = list(leaves)
                    for i, slot in fed:
                        leaves[i] = now[slot]
                    args, kwargs = tree_unflatten(leaves, spec)
                else:
                    args, kwargs = spec
                for slot, x in zip(outs, tree_flatten(func(*args, **kwargs))[0]):
                    if slot is not None:
                        now[slot] = x
            for old, slot in self.outputs:
                if slot is not None and now[slot] is not old:
                    old.copy_(now[slot])


def fake_capture(run: Callable[[], Any], device: torch.device, pool: Any = None) -> tuple[FakeGraph, Any]:
    """``cuda_capture``'s contract on any device: warm up (run once), then run ``run`` under
    ``HostCheck`` (raising ``HostAccessError`` where a CUDA capture would fail) -> (the recorded
    graph, the output of that run). Only torch's operations are recorded: the compiled CPU kernels
    (``eagle.runtime.kernels``) bypass its dispatcher, so run what is captured without them
    (``EAGLE_CPU_KERNELS=0``; a GPU's capture never meets them)."""
    run()
    check = HostCheck()
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    try:
        for name in saved:
            setattr(torch.Tensor, name, _no_host_read(name))
        with check:
            output = run()
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    return FakeGraph(check.ops, output), output
