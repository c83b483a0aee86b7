"""CUDA graphs for fixed-width forwards and whole rounds, the cache of captured round shapes, and
the one place that waits for the device.

A forward over a fixed number of tokens on a static cache launches the same kernels every time;
CapturedGraph records it once and replays it (one launch instead of hundreds). Off CUDA two
stand-ins exercise everything around the graphs on the CPU:
- RerunGraph: a replay runs the body again on the same static buffers;
- RecordedGraph: the first replay runs the body and records the operators it dispatches; later
  replays run exactly those again, on the same tensors -- every intermediate keeps its address
  and every Python value is the one seen at the recording -- and a host read inside the body
  fails. That is what a CUDA graph does, so a body that would break under capture (reading Python
  state that changes later, holding on to a fresh tensor per run, synchronising) breaks here too.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CapturedGraph:
    """One forward of a fixed width captured as a CUDA graph: static inputs, replay, and the same
    output tensor after every replay."""

    def __init__(self, tokens: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        self.tokens = tokens
        self.valid = valid
        self.out: torch.Tensor | None = None
        self.graph = None

    def capture(self, body: Callable[[], torch.Tensor], restore: Callable[[], None],
                device: torch.device) -> None:
        """Warm up on a side stream (as torch.cuda.graphs asks), capture; restore() undoes each
        run's writes to the cache state. Each graph keeps its own memory pool: outputs of one are
        read while others replay."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
                restore()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = body()
        restore()

    def record(self, body: Callable[[], object], device: torch.device,
               generators: tuple = ()) -> None:
        """Capture body() as it stands, without warming it up or running it: the caller has run it
        eagerly before (real work, so nothing to undo). `generators`: the random generators it
        draws from besides the default one (registered, so each replay draws fresh numbers)."""
        self.graph = torch.cuda.CUDAGraph()
        for generator in generators:
            register = getattr(self.graph, "register_generator_state", None)
            if register is not None and generator.device.type == "cuda":
                register(generator)
        with torch.cuda.graph(self.graph):
            self.out = body()

    def replay(self) -> None:
        self.graph.replay()


_REPLAYING = [0]


def replaying() -> bool:
    """Whether a stand-in graph's body is running now: its operators are what a captured graph
    would launch as one replay (counters of eager work outside graphs leave them out)."""
    return _REPLAYING[0] > 0


class RerunGraph(CapturedGraph):
    """Stands in for a CUDA graph off CUDA (cuda_graphs=True on CPU, for tests): a replay runs the
    body again on the same static inputs into the same output tensor, so everything around the
    graphs -- static input buffers, reused outputs, the state the body reads -- is exercised."""

    def capture(self, body, restore, device) -> None:
        self._body = body
        self.out = body()
        restore()

    def record(self, body, device, generators=()) -> None:
        self._body = body
        self.out = None           # the first replay's result; later replays write into it

    def replay(self) -> None:
        _REPLAYING[0] += 1
        try:
            result = self._body()
            if self.out is None:
                self.out = result
            elif isinstance(self.out, torch.Tensor):
                self.out.copy_(result)
            else:                 # a tuple of tensors (or None)
                for old, new in zip(self.out, result):
                    if old is not None:
                        old.copy_(new)
        finally:
            _REPLAYING[0] -= 1


# operators that read device values on the host (a CUDA graph capture fails on them)
_HOST_READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "item"}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def reads_host(func, args) -> bool:
    """Whether an ATen call reads device values on the host: the operators above, and indexing
    by a boolean mask (`x[mask]`, `x[mask] = v`), whose result's size is the mask's count -- on
    CUDA a nonzero() inside the kernel, not a call of its own, so a dispatch mode never sees it."""
    name = func.overloadpacket.__name__
    if name in _HOST_READS:
        return True
    if name in _INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class _Recording(TorchDispatchMode):
    """Records every ATen operator call (function, arguments, result) under it. `generators`: the
    ones registered with the graph; drawing from any other fails, as a CUDA capture does."""

    def __init__(self, generators: tuple = ()):
        super().__init__()
        self.calls: list = []
        self.generators = {generator._cdata for generator in generators}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_host(func, args):
            raise RuntimeError(f"{func} reads the device on the host inside a captured body: a CUDA "
                               "graph capture fails there (keep the value on the device)")
        generator = kwargs.get("generator")
        if generator is not None and generator._cdata not in self.generators:
            raise RuntimeError(f"{func} draws from a generator not registered with the graph: a CUDA "
                               "graph capture fails there (pass it in `generators`)")
        result = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, result))
        return result


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class RecordedGraph(RerunGraph):
    """The CPU stand-in with a CUDA graph's semantics (see the module docstring): record() keeps
    the body, the first replay runs it under a recording, later replays rerun the recorded
    operators with the recorded arguments and write each result into the tensor the recording
    produced (static addresses: a tensor the body handed out is updated in place)."""

    def record(self, body, device, generators=()) -> None:
        self._body = body
        self.out = None
        self._calls = None
        self._generators = tuple(generators)

    def replay(self) -> None:
        _REPLAYING[0] += 1
        try:
            if self._calls is None:
                recording = _Recording(self._generators)
                with recording:
                    self.out = self._body()
                self._calls = recording.calls
                return
            _rerun(self._calls)
        finally:
            _REPLAYING[0] -= 1


def _rerun(calls: list) -> None:
    """Run recorded ATen calls again with their recorded arguments, each result written into the
    tensor the recording produced (a CUDA graph's replay: same kernels, same addresses)."""
    for func, args, kwargs, recorded in calls:
        result = func(*args, **kwargs)
        for old, new in zip(tree_leaves(recorded), tree_leaves(result)):
            if isinstance(old, torch.Tensor) and not _same_memory(old, new):
                old.copy_(new)


def graphed_module(module: torch.nn.Module, sample_args: tuple[torch.Tensor, ...]):
    """`module` (in training mode, returning one tensor) with its forward and backward captured
    for inputs shaped as `sample_args`: torch.cuda.make_graphed_callables on CUDA -- a call copies
    its inputs into the captured ones and replays the forward graph, its backward replays the
    backward graph, each one launch -- and RecordedModule elsewhere. The inputs must keep their
    shapes and dtypes from call to call; the module must not read the device on the host, draw
    random numbers or keep Python state that changes between calls."""
    if sample_args[0].device.type == "cuda":
        return torch.cuda.make_graphed_callables(module, sample_args, allow_unused_input=True)
    return RecordedModule(module, sample_args)


class RecordedModule:
    """The CPU stand-in of torch.cuda.make_graphed_callables for one module: its forward and the
    backward of its output to its trainable parameters are recorded once (RecordedGraph's
    semantics: a host read fails, later calls rerun the recorded operators on the same tensors),
    and a call copies its inputs into the recorded ones, reruns the forward and returns an output
    whose backward reruns the backward -- so a module that would not survive a CUDA capture, or
    would compute something else when replayed, fails or differs here too."""

    def __init__(self, module: torch.nn.Module, sample_args: tuple[torch.Tensor, ...]):
        self.module = module
        self.inputs = tuple(arg.detach().clone() for arg in sample_args)
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        forward = _Recording()
        with forward:
            out = module(*self.inputs)
        self.out, self._forward = out.detach(), forward.calls
        self.grad_out = torch.ones_like(out)
        backward = _Recording()
        with backward:
            grads = torch.autograd.grad(out, self.params, grad_outputs=self.grad_out, allow_unused=True)
        self.grads, self._backward = grads, backward.calls

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return _RecordedModuleCall.apply(self, *args, *self.params)


class _RecordedModuleCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner: RecordedModule, *tensors):
        ctx.owner = owner
        for static, arg in zip(owner.inputs, tensors[:len(owner.inputs)]):
            if static.shape != arg.shape or static.dtype != arg.dtype:
                raise ValueError(f"a recorded module's input {tuple(arg.shape)} {arg.dtype} differs from "
                                 f"the recorded {tuple(static.shape)} {static.dtype}: keep every call's shapes")
            static.copy_(arg)
        _rerun(owner._forward)
        return owner.out.clone()

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner
        owner.grad_out.copy_(grad)
        _rerun(owner._backward)
        return (None,) + (None,) * len(owner.inputs) + tuple(
            None if g is None else g.clone() for g in owner.grads)


class RoundGraph:
    """One round shape captured: its parts ("draft", "accept"), each recorded on its first run and
    replayed from then on (a CUDA graph on CUDA, a RecordedGraph elsewhere)."""

    def __init__(self, device: torch.device, generators: tuple, holds: tuple,
                 counts: dict[str, int] | None = None):
        self.device, self.generators = device, generators
        self.holds = holds              # what the shape's key names by id: kept alive with the graphs
        self.parts: dict[str, CapturedGraph] = {}
        self.counts = counts if counts is not None else {"captures": 0}

    def run(self, part: str, body: Callable):
        graph = self.parts.get(part)
        if graph is None:
            graph = self.parts[part] = (CapturedGraph if self.device.type == "cuda" else RecordedGraph)()
            graph.record(body, self.device, self.generators)
            self.counts["captures"] += 1
        graph.replay()
        return graph.out


class RoundGraphs:
    """The captured round shapes of one static cache. A shape runs eagerly `warmup` times (real
    work, which also picks kernels and allocates workspaces), is captured on its next run and
    replayed from then on; the `capacity` most recently used shapes are kept.

    `counts`: the captures (one per part of a shape) and the rounds run eagerly so far. Once every
    shape a decoder uses is captured, a call adds to neither: a capture inside a timed run costs
    milliseconds (a device synchronisation, the capture and its instantiation), so a shape that
    first appears there -- a narrower draft near the end of a call, say -- would be paid for in it.
    """

    def __init__(self, warmup: int, capacity: int):
        self.warmup, self.capacity = warmup, capacity
        self.graphs: OrderedDict[tuple, RoundGraph] = OrderedDict()
        self.seen: dict[tuple, int] = {}        # shape -> eager runs so far
        self.counts = {"captures": 0, "eager_rounds": 0}

    def get(self, key: tuple, device: torch.device, generators: tuple,
            holds: tuple) -> RoundGraph | None:
        """The shape's graph, or None while it still runs eagerly."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= self.warmup:
            self.counts["eager_rounds"] += 1
            return None
        graph = self.graphs[key] = RoundGraph(device, generators, holds, self.counts)
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return graph

    def shapes(self) -> dict[tuple, list[str]]:
        """{shape key: its captured parts}, least recently used first."""
        return {key: sorted(graph.parts) for key, graph in self.graphs.items()}
