"""A model's weight loading, recorded once and replayed as plain copies.

vLLM's `load_weights` maps each HF tensor onto fused, tensor-parallel
parameters in Python (name mapping, q/k/v and gate/up stacking, TP
narrowing): on large models more host time than the GPU spends copying
them, on every sync (docs/history/benchmarks-diary.md). That mapping depends on names and
shapes, never on values, so `CopyPlan` records it the first time a tensor is
loaded (which slice of the incoming tensor each `copy_` writes into which
slice of which parameter) and later syncs make those copies directly.

A loader that does anything else with an incoming tensor (arithmetic, a
concatenation, `.item()`, an in-place op, a copy into a temporary) cannot be
replayed as copies: recording refuses it, and that model keeps going through
its own loader on every sync.

When the very same incoming tensors will be loaded again (a colocated
trainer's parameters, kept mapped between CUDA IPC syncs), the copies are
captured once as a CUDA graph: later loads are one check and one launch
instead of a check and a launch per copy (docs/history/benchmarks-diary.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

Loader = Callable[[list[tuple[str, Any]]], Any]

# Functions that read an incoming tensor's metadata, never its values.
_METADATA = frozenset(
    {
        "shape",
        "size",
        "ndim",
        "dim",
        "dtype",
        "device",
        "layout",
        "is_cuda",
        "is_contiguous",
        "is_floating_point",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "requires_grad",
        "__len__",
    }
)


@dataclass(frozen=True)
class _Copy:
    """`dst.copy_(incoming.as_strided(size, stride, incoming's offset + offset))`."""

    dst: Any  # a view of a parameter, kept from the recording
    param: Any  # the parameter `dst` views
    data_ptr: int  # where that parameter's memory was when recorded
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    whole: bool  # the source is the incoming tensor itself (the common case)

    def source(self, incoming: Any) -> Any:
        if self.whole:
            return incoming
        return incoming.as_strided(self.size, self.stride, incoming.storage_offset() + self.offset)


def _layout(tensor: Any) -> tuple:
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _op_name(func: Any) -> str:
    parts = (resolve_name(func) or getattr(func, "__name__", repr(func))).split(".")
    return parts[-2] if parts[-1] in ("__get__", "__set__") else parts[-1]


class CopyPlan:
    """Loads weights into `model` through `loader`, or by replaying the copies
    `loader` made for the same names and layouts before."""

    def __init__(self, model: Any, loader: Loader):
        self.model = model
        self.loader = loader
        # name -> (the incoming tensor's layout, its copies)
        self._copies: dict[str, tuple[tuple, list[_Copy]]] = {}
        self.refused: str | None = None  # why this model's loader cannot be replayed
        self._graph: _Graph | None = None
        self.graph_error: str | None = None  # why capturing failed (then never again)

    def load(
        self, weights: list[tuple[str, Any]], *, repeat: bool = False, token: str | None = None
    ) -> None:
        """Load `weights`; `repeat`: these same tensors (same memory) will be
        loaded again, so their copies are worth capturing as a CUDA graph.
        `token`: names these very tensor objects (a CUDA IPC mapping the
        worker keeps): a graph captured under it applies again without
        comparing the tensors' names, addresses and layouts one by one."""
        with torch.no_grad():
            graph = self._graph
            if token is not None and graph is not None and graph.token == token:
                if _unmoved(graph.params):
                    graph.graph.replay()
                    return
            # The common case (buckets) needs no key: no graph, none wanted.
            key = _key(weights) if repeat or self._graph is not None else None
            if self._graph is not None and self._graph.applies(key):
                # One check for the whole graph, not one per tensor's copies.
                self._graph.graph.replay()
                return
            planned = [self._planned(name, tensor) for name, tensor in weights]
            if any(copies is None for copies in planned):
                # All through the loader, in order: a loader may write one
                # place from two tensors, and the later one must win.
                self._record(weights)
                return
            if repeat and weights[0][1].is_cuda and self.graph_error is None:
                self._graph = self._capture(key, weights, planned, token)
                if self._graph is not None:
                    self._graph.graph.replay()
                    return
            self._copy(weights, planned)

    @staticmethod
    def _copy(weights: list[tuple[str, Any]], planned: list[list[_Copy]]) -> None:
        for (_, tensor), copies in zip(weights, planned, strict=True):
            for copy in copies:
                copy.dst.copy_(copy.source(tensor), non_blocking=True)

    def _capture(
        self,
        key: tuple,
        weights: list[tuple[str, Any]],
        planned: list[list[_Copy]],
        token: str | None,
    ) -> _Graph | None:
        """The copies as a CUDA graph (not run), or None if capture fails."""
        device = weights[0][1].device
        graph = torch.cuda.CUDAGraph()
        # Captured on a side stream (a graph cannot be captured on the
        # default stream); thread-local, so other threads' CUDA calls do not
        # break the capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._copy(weights, planned)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            self.graph_error = str(exc)
            logger.warning("capturing weight copies as a CUDA graph failed: %s", exc)
            return None
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
        params = {id(c.param): (c.param, c.data_ptr) for copies in planned for c in copies}
        return _Graph(key, tuple(params.values()), graph, token)

    def _planned(self, name: str, tensor: Any) -> list[_Copy] | None:
        """The copies recorded for this tensor, if they still apply."""
        layout, copies = self._copies.get(name, (None, None))
        if copies is None or layout != _layout(tensor) or not _in_place(copies):
            return None
        return copies

    def _record(self, weights: list[tuple[str, Any]]) -> None:
        self._graph = None  # its copies may be the ones being replaced
        if self.refused is not None:
            self.loader(weights)
            return
        recorder = _Recorder(dict(weights), self.model)
        with recorder:
            self.loader(weights)
        if recorder.refused is not None:
            self.refused = recorder.refused
            self._copies.clear()
            logger.warning(
                "weight loading cannot be replayed as copies (%s): every sync goes "
                "through the model's own loader",
                self.refused,
            )
            return
        for name, tensor in weights:
            self._copies[name] = (_layout(tensor), recorder.copies[name])

    @property
    def captured(self) -> bool:
        """Loads of the tensors loaded last with `repeat` replay a CUDA graph."""
        return self._graph is not None

    @property
    def size(self) -> int:
        """Copies recorded."""
        return sum(len(copies) for _, copies in self._copies.values())


def _in_place(copies: list[_Copy]) -> bool:
    # A parameter given new memory since the recording (e.g. `param.data =
    # ...`) would leave the recorded views on the old memory.
    return _unmoved((c.param, c.data_ptr) for c in copies)


def _unmoved(params: Iterable[tuple[Any, int]]) -> bool:
    """Every parameter still at the address recorded for it."""
    # vLLM's parameters are tensor subclasses with a Python __torch_function__,
    # which each data_ptr() would run through (over 20x the cost).
    with torch._C.DisableTorchFunctionSubclass():
        return all(param.data_ptr() == address for param, address in params)


def _key(weights: list[tuple[str, Any]]) -> tuple:
    """The incoming tensors' names, addresses and layouts: what a CUDA graph
    of their copies depends on."""
    return tuple((name, t.data_ptr(), _layout(t)) for name, t in weights)


@dataclass(frozen=True)
class _Graph:
    """Copies captured as one CUDA graph: between fixed addresses, so they are
    these copies exactly while the incoming tensors (`key`) and the
    destination parameters (`params`, with their addresses) sit where they sat."""

    key: tuple
    params: tuple[tuple[Any, int], ...]
    graph: Any
    token: str | None = None  # see CopyPlan.load

    def applies(self, key: tuple) -> bool:
        return key == self.key and _unmoved(self.params)


class _Recorder(TorchFunctionMode):
    """Watches every torch function the loader calls: views of an incoming
    tensor are followed, `param_view.copy_(incoming_view)` is recorded, and
    anything else done to an incoming tensor refuses the recording."""

    def __init__(self, incoming: dict[str, Any], model: Any):
        super().__init__()
        # id -> (incoming name, the tensor): the incoming tensors and the views
        # taken of them (held here, so ids are not reused while recording).
        self.origin = {id(t): (name, t) for name, t in incoming.items()}
        self.incoming = incoming
        self.copies: dict[str, list[_Copy]] = {name: [] for name in incoming}
        self.refused: str | None = None
        self.params = {
            p.untyped_storage().data_ptr(): p
            for p in list(model.parameters()) + list(model.buffers())
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refused is not None:
            return func(*args, **kwargs)
        tracked = [a for a in tree_leaves((args, kwargs)) if id(a) in self.origin]
        if not tracked:
            return func(*args, **kwargs)
        name = _op_name(func)
        if name == "copy_":
            self._record_copy(args, kwargs)
            return func(*args, **kwargs)
        dunder = name.startswith("__") and name.endswith("__")
        in_place = name.endswith("_") and not dunder or name.startswith("__i")
        if in_place or name == "__setitem__":
            self.refused = f"{name} on an incoming tensor"
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        self._follow(name, result, tracked)
        return result

    def _record_copy(self, args: tuple, kwargs: dict) -> None:
        dst, src = args[0], args[1]
        param = self.params.get(dst.untyped_storage().data_ptr())
        if id(dst) in self.origin or id(src) not in self.origin or len(args) > 2:
            self.refused = "copy_ into an incoming tensor"
        elif set(kwargs) - {"non_blocking"}:
            self.refused = f"copy_ with {sorted(kwargs)}"
        elif param is None:
            self.refused = "copy_ of an incoming tensor into a temporary"
        else:
            name = self.origin[id(src)][0]
            base = self.incoming[name]
            offset = src.storage_offset() - base.storage_offset()
            size, stride = tuple(src.shape), tuple(src.stride())
            self.copies[name].append(
                _Copy(
                    dst=dst,
                    param=param,
                    data_ptr=param.data_ptr(),
                    offset=offset,
                    size=size,
                    stride=stride,
                    whole=offset == 0 and (size, stride) == _layout(base)[1:],
                )
            )

    def _follow(self, name: str, result: Any, tracked: list[Any]) -> None:
        tensors = result if isinstance(result, tuple | list) else [result]
        if not any(isinstance(t, torch.Tensor) for t in tensors):
            if name not in _METADATA:
                self.refused = f"{name} read an incoming tensor's values"
            return
        origin_name = self.origin[id(tracked[0])][0]
        base = self.incoming[origin_name]
        for tensor in tensors:
            is_view = (
                isinstance(tensor, torch.Tensor)
                and len({self.origin[id(t)][0] for t in tracked}) == 1
                and tensor.dtype == base.dtype
                and tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            )
            if not is_view:
                self.refused = f"{name} computed a new tensor from an incoming one"
                return
            self.origin[id(tensor)] = (origin_name, tensor)
