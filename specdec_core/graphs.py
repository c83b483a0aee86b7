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


class _Recording(TorchDispatchMode):
    """Records every ATen operator call (function, arguments, result) under it. `generators`: the
    ones registered with the graph; drawing from any other fails, as a CUDA capture does."""

    def __init__(self, generators: tuple = ()):
        super().__init__()
        self.calls: list = []
        self.generators = {generator._cdata for generator in generators}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _HOST_READS:
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
            for func, args, kwargs, recorded in self._calls:
                result = func(*args, **kwargs)
                for old, new in zip(tree_leaves(recorded), tree_leaves(result)):
                    if isinstance(old, torch.Tensor) and not _same_memory(old, new):
                        old.copy_(new)
        finally:
            _REPLAYING[0] -= 1


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
