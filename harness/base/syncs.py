"""Counting the operations that make the host wait for the device, on any device.

On a GPU the host queues kernels and runs ahead; three kinds of operation stop it until
the device has caught up:

* a scalar read (``.item()``, ``float(t)``, ``bool(t)``, ``if t:``, ``.tolist()`` of a
  CUDA tensor): ATen's ``_local_scalar_dense``;
* a copy from the device to the host (``.cpu()``, ``.to("cpu")``, ``.numpy()`` after one);
* an operation whose output shape depends on the data (``nonzero``, ``torch.where(mask)``,
  boolean-mask indexing ``x[mask]``, ``masked_select``, ``unique``): the host needs the
  size to allocate the output.

:class:`SyncCounter` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every ATen call made inside it and counts those three kinds, on the CPU as on a
GPU: the stalls a training step would cause on a GPU are counted on a machine without
one (the CPU itself never waits, so this is a count of where it would).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SyncCounter", "SHAPE_DEPENDENT_OPS"]

_aten = torch.ops.aten

#: Operations whose output shape depends on the values of their input (any overload).
SHAPE_DEPENDENT_OPS = frozenset(
    {
        _aten.nonzero,
        _aten.nonzero_numpy,
        _aten.argwhere,
        _aten.masked_select,
        _aten._unique,
        _aten._unique2,
        _aten.unique_dim,
        _aten.unique_consecutive,
        _aten.unique_dim_consecutive,
    }
)
#: Indexing operations that are shape-dependent when an index is a boolean mask.
_MASK_INDEXING = frozenset({_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_})


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _is_device_to_host(func, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    if func.overloadpacket not in (_aten._to_copy, _aten.copy_, _aten.copy):
        return False
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    return any(t.device.type != "cpu" for t in tensors) and any(
        t.device.type == "cpu" for t in tensors
    )


#: Tensor methods that hand the host a copy of the data: on a device tensor, a
#: device-to-host transfer. A CPU tensor's return its memory without an ATen call, so
#: the counter sees them by wrapping the methods.
_HOST_COPIES = ("tolist", "numpy", "cpu")


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as counter: ...``; then ``counter.scalar_reads``,
    ``counter.device_to_host`` and ``counter.shape_dependent`` (totals outside any
    :meth:`section`), ``counter.ops`` (the ATen names behind the shape-dependent ones) and
    ``counter.sections`` (``{section: Counter}`` of what ran inside each named section).

    ``.tolist()``, ``.numpy()`` and ``.cpu()`` count as device-to-host copies on any tensor
    (on a CPU-only machine every tensor stands for a device tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalar_reads = 0
        self.device_to_host = 0
        self.shape_dependent = 0
        self.ops: Counter[str] = Counter()
        self.sections: dict[str, Counter[str]] = {}
        self._section: str | None = None
        self._originals: dict[str, Any] = {}
        self._copying = False  # inside a counted host copy: its own ATen copy is not another

    @property
    def syncs(self) -> int:
        """Scalar reads and device-to-host copies: the waits a step asks for explicitly."""
        return self.scalar_reads + self.device_to_host

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Count what runs inside under ``sections[name]`` instead of the totals (e.g. a
        miner, whose output size depends on the data by nature)."""
        outer, self._section = self._section, name
        self.sections.setdefault(name, Counter())
        try:
            yield
        finally:
            self._section = outer

    def _count(self, kind: str, op: str = "") -> None:
        if self._section is not None:
            self.sections[self._section][kind] += 1
            return
        if kind == "scalar_reads":
            self.scalar_reads += 1
        elif kind == "device_to_host":
            self.device_to_host += 1
        else:
            self.shape_dependent += 1
            self.ops[op] += 1

    def __enter__(self):
        for name in _HOST_COPIES:
            original = self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
        return super().__exit__(*exc)

    def _counting(self, method):
        counter = self

        def counted(tensor, *args, **kwargs):
            if counter._copying:  # a host copy inside another (e.g. numpy() of cpu())
                return method(tensor, *args, **kwargs)
            counter._count("device_to_host")
            counter._copying = True
            try:
                return method(tensor, *args, **kwargs)
            finally:
                counter._copying = False

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet is _aten._local_scalar_dense:
            self._count("scalar_reads")
        elif packet in SHAPE_DEPENDENT_OPS or (packet in _MASK_INDEXING and _has_mask_index(args)):
            self._count("shape_dependent", str(packet))
        elif not self._copying and _is_device_to_host(func, args, kwargs, out):
            self._count("device_to_host")
        return out
