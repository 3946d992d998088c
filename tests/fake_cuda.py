"""A CPU stand-in for the CUDA runtime calls the project makes, so that its CUDA-only lines run in CPU tests.

The ``fake_cuda`` fixture installs it: ``torch.cuda`` then reports ``FakeCuda.count`` GPUs, and a tensor "on" ``cuda:i``
is a CPU tensor of class ``CudaTensor`` whose ``device`` says ``cuda:i``, so every ``device.type == "cuda"`` branch
runs, on the CPU's numbers. A ``TorchFunctionMode``, entered in every thread started while it is installed, moves
tensors to and from the fake devices and checks what CUDA checks:

- device arguments go through torch.cuda's own ``_get_device_index``: ``set_device(torch.device("cuda"))`` raises
  ``ValueError`` as it does on a GPU; an index past the count raises; ``current_stream("cpu")`` raises;
- the current device and the current stream are per thread, and a new thread starts on device 0, as in CUDA's runtime;
- an op whose tensors sit on two devices raises, as CUDA kernels do (CPU indices of ``x[i]`` and the source of a copy
  are allowed, and a CPU 0-dim tensor as an input, as TensorIterator's element-wise kernels take it: never as what the
  op writes, ``out=`` or the tensor an in-place op changes, nor inside ``cat``/``stack``); ``numpy()`` of a CUDA tensor
  raises; ``pin_memory`` of a CUDA tensor raises;
- the RNG state functions take a device index below the count (``IndexError`` past it, as CUDA's per-device generators);
  each device has its own state;
- an event records on a stream of its own device (after its first record); ``record_stream`` takes a stream, of a CUDA
  tensor; an event's ``query`` is True (the GPU keeps up: the host now knows its stream has passed it, which is no
  wait) unless ``lagging`` is set, when it is True only for what the host has waited for;
- a forked worker process that touches CUDA raises, as CUDA's runtime cannot be used after a fork;
- ``torch.autocast("cuda")`` casts the stand-in's tensors as CPU autocast does (bf16 inputs meet bf16 weights).

How memory is used across streams, as the caching allocator and the stream order decide it. Every op runs on its
thread's current stream, which counts its ops (a logical clock); what each storage went through is kept in a
``Block``: the stream it was allocated on, its last write, the reads since, every stream's last use. An op on one
stream that reads memory another stream wrote, or writes memory another stream read or wrote, must be ordered after
that use: its stream waited for an event recorded after it (``wait_event``, ``wait_stream``), or the host waited for
the other stream since (``synchronize``, a syncing op). When a storage is freed, each use on a stream other than the
one it was allocated on must be ordered likewise before that stream's next op, or marked by ``record_stream``:
otherwise the caching allocator, which hands a freed block to the next allocation on its own stream at once, could
give it to new work while the other stream still uses it; that is raised at the next op (or when the test ends).
Writes through a view are writes of its base's memory. A view runs no kernel: making one neither reads nor writes
(using it does). These rules, and the ones below, raise ``Race`` (not a RuntimeError: no code should handle them).

Stricter than CUDA, to catch what CUDA lets pass silently (and what this project's stream hand-offs rely on):

- waiting on an event that was never recorded raises (CUDA: a no-op, so nothing is ordered);
- ``record_stream`` takes a stream of the tensor's own device;
- memory is judged per storage: two streams that use disjoint parts of one storage without ordering are refused,
  where CUDA would let them run (nothing here does that);
- torchvision's ``decode_jpeg`` on CUDA (stood in for by ``torchvision_decode``, which decodes on the CPU) requires the
  current stream of the target device (torchvision switches to that device itself, whatever the thread's current one)
  to have no queued work the host has not waited for (nvJPEG writes the outputs, allocated on the current stream,
  from a stream of its own, which does not wait for the current one; the current stream then waits for it), and
  refuses to run under the ``cudaMallocAsync`` backend; after a decode that failed part-way, nothing may be allocated
  on that stream until ``torch.cuda.synchronize`` (the decoder's stream may still write into the outputs it freed).
  TorchCodec's (``torchcodec_decode``) does the same and the host waits for the current stream before and for its
  own after, as TorchCodec 0.17 does. nvImageCodec's (``nvimgcodec_decode``) writes memory of its own in the current
  stream's order. ``use_decoders`` picks which ``data.decode`` uses.

Page-locked memory (``pin_memory``) is known by its storage, views of it included. A ``non_blocking`` copy from it is
read when the copy runs, so the host must not write that memory until it knows the copy has run (a ``synchronize``,
or an event after it that ``query`` found passed): an earlier write raises ``Race``.

CUDA graphs (``torch.cuda.CUDAGraph``, ``torch.cuda.graph``): capture enters the stream it is given (a stream of the
default stream refused, as PyTorch refuses it) after a device-wide synchronize, as PyTorch's context does; a host sync
while capturing raises CUDA's error. The aten ops run during the capture are recorded (backward's included), and the
tensors made before it are put back when it ends, since a capture computes nothing; ``replay`` runs the ops again on
the current stream into the same tensors, reading the tensors made before the capture as they are then (checked for
ordering as one op that reads those and writes the captured ones).

Host syncs are counted per thread in ``syncs``: ``item``, ``bool``, ``tolist``, ``nonzero``, ``torch.equal``, copies to
the CPU, blocking copies to the GPU (CUDA's ``memcpy_and_sync``), ``non_blocking`` copies from pageable memory (CUDA
stages them synchronously), a device tensor made from host data, an index held on the CPU, a boolean mask,
``torch.nested.to_padded_tensor`` of floating-point images (CUDA's one-kernel path copies the sizes over with a blocking
copy; other dtypes are padded image by image on the device), and the ``synchronize`` calls; set ``trace`` to a list to
collect where each happened. A ``non_blocking`` copy to the CPU is refused: its data is undefined on CUDA until the host
waits, which the stand-in does not model.
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import threading
import weakref

import pytest
import torch
from torch.cuda._utils import _get_device_index
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

RUNTIME: FakeCuda | None = None  # the installed stand-in


def _runtime() -> FakeCuda:
    if RUNTIME is None:
        raise RuntimeError("fake CUDA: used outside the fake_cuda fixture")
    return RUNTIME


class Race(AssertionError):
    """A use of streams or memory that CUDA lets pass but that can race (the rules "stricter than CUDA" above): the code
    under test is wrong. Not a RuntimeError, which the project may catch as a CUDA failure and work around."""


class CudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:<_index>``; what was done to its memory is in ``FakeCuda.blocks``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    @property
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:
        return self._index

    def __reduce_ex__(self, protocol):
        # saved as what torch.load(map_location="cpu") would give back
        with torch._C.DisableTorchFunction():
            plain = self.as_subclass(torch.Tensor)
        return plain.__reduce_ex__(protocol)


class PinnedTensor(torch.Tensor):
    """A CPU tensor in page-locked memory (``pin_memory``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class Stream:
    """``torch.cuda.Stream``: ops run on it in order; ``clock`` counts them, ``done`` is the last the host waited for,
    ``seen[s]`` the clock of stream ``s`` this stream has waited for on the device."""

    _ids = itertools.count()

    def __init__(self, device=None, priority: int = 0, name: str | None = None):
        index = _get_device_index(device, optional=True)
        runtime = _runtime()
        runtime.check_index(index)
        self.device_index, self.clock, self.done, self.seen = index, 0, 0, {}
        self.name = name or f"stream {next(self._ids)} of cuda:{index}"
        runtime.streams.append(self)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def __repr__(self):
        return f"<fake {self.name}>"

    def wait_event(self, event: Event):
        if not isinstance(event, Event):
            raise TypeError(f"wait_event expects a torch.cuda.Event, got {type(event).__name__}")
        if event.stream is None:
            raise Race(f"fake CUDA: {self} waits on an event that was never recorded; CUDA would not wait at "
                               "all (cudaStreamWaitEvent on an unrecorded event is a no-op)")
        # ordering is transitive: what the recording stream had waited for, this one now has too
        for stream, clock in [*event.seen.items(), (event.stream, event.clock)]:
            self.seen[stream] = max(self.seen.get(stream, 0), clock)

    def wait_stream(self, stream: Stream):
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        _runtime().host_waits(self)

    def query(self) -> bool:
        return _runtime().passed(self, self.clock)

    def is_capturing(self) -> bool:  # what the optimizers' graph-capture check asks torch.accelerator's stream
        return _runtime().capturing is self

    @property
    def cuda_stream(self) -> int:
        return id(self)


class Block:
    """What the caching allocator would know of one storage on a fake GPU: ``stream``, the stream it was allocated on
    (whose pool it goes back to when freed); ``writer``, (stream, clock) of its last write; ``reads``, the streams that
    read it since, each with the clock of its last read; ``uses``, each stream's last use; ``recorded``, the streams
    ``record_stream`` marked. Freeing the storage calls ``FakeCuda.freed``."""

    def __init__(self, stream: Stream, storage: torch.UntypedStorage, runtime: FakeCuda, writer: Stream | None = None):
        writer = writer or stream
        self.stream, self.writer, self.reads = stream, (writer, writer.clock), {}
        self.uses, self.recorded = {writer: writer.clock}, set()
        weakref.finalize(storage, runtime.freed, storage.data_ptr()).atexit = False


class Event:
    """``torch.cuda.Event``: ``record`` notes the stream, its clock and what it had waited for."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.stream, self.clock, self.seen = None, 0, {}

    def record(self, stream: Stream | None = None):
        stream = stream or _runtime().current_stream()
        if self.stream is not None and self.stream.device_index != stream.device_index:
            raise RuntimeError(f"Event device index {self.stream.device_index} does not match recording stream's "
                               f"device index {stream.device_index}.")
        self.stream, self.clock, self.seen = stream, stream.clock, dict(stream.seen)

    def wait(self, stream: Stream | None = None):
        (stream or _runtime().current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.stream is None or _runtime().passed(self.stream, self.clock)

    def synchronize(self):
        if self.stream is not None:
            _runtime().host_waits(self.stream, self.clock)

    def elapsed_time(self, end: Event) -> float:
        return 0.0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


class _Recorder(TorchDispatchMode):
    """The aten ops of a capture, into ``graph.ops``.

    A capture runs nothing on a GPU, so the tensors made before it that these ops take are kept as they were
    (``saved``) and put back when it ends."""

    def __init__(self, graph: CUDAGraph):
        super().__init__()
        self.graph, self.made, self.saved = graph, set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (a host sync)")
        # every tensor made before the capture that an op takes, as it was: an op's schema does not always say what it
        # writes (native_batch_norm's running statistics)
        for t in (t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key[0] not in self.made and key not in self.saved:
                self.saved[key] = (t, t.clone())
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        self.made.update(t.untyped_storage().data_ptr() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def restore(self):
        for t, before in reversed(list(self.saved.values())):
            t.copy_(before)


class _StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream of its device, and its device the current one, inside."""

    def __init__(self, stream: Stream | None):
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"torch.cuda.stream expects a torch.cuda.Stream or None, got {type(stream).__name__}")
        self.stream = stream

    def __enter__(self):
        if self.stream is not None:
            runtime = _runtime()
            self.previous = runtime.current_device(), runtime.current_stream(self.stream.device_index)
            runtime.set_stream(self.stream)

    def __exit__(self, *exc):
        if self.stream is not None:
            runtime = _runtime()
            runtime.set_stream(self.previous[1])
            runtime.local.device = self.previous[0]


class CUDAGraph:
    """``torch.cuda.CUDAGraph``. Its capture (``torch.cuda.graph``, :class:`_GraphCapture`) records the aten ops that
    run, what would be the graph's kernels, backward's and the optimizer's included (``ops``), and the stream ops the
    stand-in orders (``tape``) with the storages made during the capture (``made``). ``replay`` is ordered as one op on
    the current stream that reads the tensors made before the capture and writes the captured ones, and runs the aten
    ops again on the same tensors, writing each result into the tensor the capture got, as a graph's kernels rewrite
    its memory. What Python computed during the capture is replayed as a constant, as on a GPU: a learning rate passed
    as a float, an index that moves from step to step."""

    def __init__(self, keep_graph: bool = False):
        self.tape, self.made, self.ops = None, set(), []
        self.replays = 0

    def replay(self):
        if self.tape is None:
            raise RuntimeError("CUDA graph: replay() of a graph that was never captured")
        _runtime().replay(self)

    def reset(self):
        self.tape, self.ops = None, []


class _GraphCapture:
    """``torch.cuda.graph(graph, pool=None, stream=None)``: the host waits for the device (as PyTorch's context does),
    then captures on ``stream``, a side stream (the default stream refused, as PyTorch refuses it); a host sync inside
    raises, as CUDA refuses one during a capture. A capture runs nothing on a GPU: the tensors made before it that its
    ops wrote are put back as they were when it ends, and random ops draw nothing from the generator (a graph reserves
    its draws, and each replay takes the next ones)."""

    def __init__(self, cuda_graph: CUDAGraph, pool=None, stream: Stream | None = None, capture_error_mode="global"):
        self.graph, self.stream = cuda_graph, stream

    def __enter__(self):
        runtime = _runtime()
        runtime.synchronize()
        stream = self.stream or Stream(runtime.current_device())
        if stream in runtime.default_streams:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, after capture, it's ok "
                               "to replay them on the default stream.)")
        self.context = _StreamContext(stream)
        self.context.__enter__()
        self.graph.tape, self.graph.made, self.graph.ops = [], set(), []
        self.rng_state = torch.get_rng_state()  # the stand-in's CUDA tensors draw from the CPU generator
        runtime.capturing, runtime.captured = stream, self.graph
        self.recorder = _Recorder(self.graph)
        self.recorder.__enter__()

    def __exit__(self, *exc):
        self.recorder.__exit__(*exc)
        runtime = _runtime()
        runtime.capturing = runtime.captured = None
        with torch._C.DisableTorchFunction(), torch.no_grad():
            self.recorder.restore()
        torch.set_rng_state(self.rng_state)
        self.context.__exit__(*exc)


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cuda"


# ops that take tensors of another device than their result: the CPU indices of x[i] / x[i] = v (copies between
# devices are FakeCuda.copy_ and FakeCuda.to)
_CROSS_DEVICE = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_}
# what reads no data (attributes, shapes, views' bookkeeping, hooks): no kernel, nothing ordered
_METADATA = {"__get__", "__set__", "__delete__", "dim", "size", "stride", "numel", "nelement", "ndimension",
             "is_contiguous", "data_ptr", "element_size", "untyped_storage", "storage_offset", "__len__",
             "is_floating_point", "is_complex", "requires_grad_", "register_hook", "retain_grad", "__hash__", "type",
             "is_leaf", "_is_view", "backward", "_has_compatible_shallow_copy_type", "is_same_size", "__repr__",
             "__reduce_ex__", "__deepcopy__", "as_subclass"}
# ops that take no CPU tensor with CUDA ones, not even a 0-dim one (no TensorIterator, which alone takes CPU scalars)
_NO_CPU_SCALARS = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack}
# factories that copy host data (not a tensor) to the device: a pageable copy, which the host waits for
_FROM_HOST = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}
# in-place ops that write their first argument without reading it
_FILLS = {"copy_", "fill_", "zero_", "__setitem__", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"}
# ops whose result the host waits for
_SYNCING = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
            torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.equal, torch.Tensor.equal,
            torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique, torch.Tensor.__format__}


class _Mode(TorchFunctionMode):
    def __init__(self, runtime: FakeCuda):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = self.runtime.special.get(func)
        if special is not None:
            return special(*args, **kwargs)
        return self.runtime.run(func, args, kwargs)


class FakeCuda:
    """The stand-in's state: devices, streams, counts. ``count`` GPUs, each with ``free`` of ``total`` bytes."""

    def __init__(self, count: int = 2, free: int = 8 << 30, total: int = 16 << 30):
        self.count, self.free, self.total = count, free, total
        self.backend = "native"  # torch.cuda.get_allocator_backend()
        self.pid = os.getpid()
        self.local = threading.local()
        self.streams: list[Stream] = []
        self.lock = threading.RLock()
        self.syncs: collections.Counter = collections.Counter()  # thread name -> host syncs
        self.blocks: dict[int, Block] = {}  # storage address -> what the caching allocator would know of it
        self.faults: list[str] = []  # uses found wrong when a block was freed, raised at the next op (_raise_faults)
        self.dirty: dict[int, Stream] = {}  # device -> stream a failed decode may still write into
        self.decodes = 0  # JPEG decoder calls on CUDA
        # device -> the stream TorchCodec's and torchvision's nvJPEG write from
        self.decoder_streams: dict[int, Stream] = {}
        self.replays = 0  # CUDA graph replays
        self.set_devices: list[tuple[str, int]] = []  # (thread name, index) of every set_device
        self.largest_host_tensor = 0  # bytes, among CPU tensors made in the main thread
        self.default_streams = []
        self.trace = None  # a list: where each host sync happened
        self.lagging = False  # event and stream queries answer False for what the host has not waited for
        self.pinned: dict[int, list[tuple[Stream, int]]] = {}  # page-locked storage -> the copies that read it
        self.capturing: Stream | None = None  # the stream a CUDA graph is being captured on
        self.captured: CUDAGraph | None = None
        self.rng_states = [self._seeded(0) for _ in range(count)]  # per device, as CUDA's default generators
        global RUNTIME
        RUNTIME = self
        self.default_streams = [Stream(i, name=f"default stream of cuda:{i}") for i in range(count)]
        self.special = {
            torch.Tensor.to: self.to, torch.Tensor.cuda: self.cuda, torch.Tensor.cpu: self.cpu,
            torch.Tensor.pin_memory: self.pin_memory, torch.Tensor.is_pinned: self.is_pinned,
            torch.Tensor.numpy: self.numpy, torch.Tensor.copy_: self.copy_,
        }

    # ---------------------------------------------------------------------------------------- devices and streams
    def check_index(self, index: int):
        if not 0 <= index < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")

    def check_process(self):
        if os.getpid() != self.pid:
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you "
                               "must use the 'spawn' start method")

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device):
        index = _get_device_index(device)  # torch.cuda.set_device's own argument check
        if index >= 0:
            self.check_index(index)
            self.local.device = index
            self.set_devices.append((threading.current_thread().name, index))

    def current_stream(self, device=None) -> Stream:
        index = _get_device_index(device, optional=True)
        self.check_index(index)
        streams = self.local.__dict__.setdefault("streams", {})
        return streams.get(index, self.default_streams[index])

    def set_stream(self, stream: Stream):
        self.local.__dict__.setdefault("streams", {})[stream.device_index] = stream
        self.local.device = stream.device_index

    def host_waits(self, stream: Stream, clock: int | None = None, why: str = ""):
        if self.capturing is not None:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({why or 'a host wait'})")
        stream.done = max(stream.done, stream.clock if clock is None else clock)
        self.syncs[threading.current_thread().name] += 1
        if self.trace is not None:
            import traceback
            self.trace.append((threading.current_thread().name, why, "".join(traceback.format_stack(limit=12)[:-2])))

    def passed(self, stream: Stream, clock: int) -> bool:
        """A query: whether the GPU has passed op ``clock`` of ``stream``; if so the host knows it from now on."""
        if self.lagging and stream.done < clock:
            return False
        stream.done = max(stream.done, clock)
        return True

    def synchronize(self, device=None):
        if self.capturing is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (synchronize)")
        index = _get_device_index(device, optional=True)
        self.check_index(index)
        for stream in self.streams:
            if stream.device_index == index:
                stream.done = stream.clock
        self.dirty.pop(index, None)
        self.syncs[threading.current_thread().name] += 1

    # -------------------------------------------------------------------------------------------------- RNG states
    @staticmethod
    def _seeded(seed: int) -> torch.Tensor:
        """A CUDA generator's state: its seed and its offset, 8 bytes each."""
        return torch.tensor([seed % 2**63, 0], dtype=torch.int64).view(torch.uint8)

    def generator(self, device) -> int:
        """The index of the generator that torch.cuda's RNG state functions take for ``device``:
        ``default_generators[index]``, an IndexError past the count."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = self.current_device() if device.index is None else device.index
        if index >= self.count:
            raise IndexError("tuple index out of range")
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng_states[self.generator(device)].clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda"):
        if new_state.dtype != torch.uint8 or new_state.shape != (16,):
            raise RuntimeError("RNG state is wrong size")
        self.rng_states[self.generator(device)] = new_state.clone()

    def manual_seed(self, seed: int, all_devices: bool = False):
        for index in range(self.count) if all_devices else [self.current_device()]:
            self.rng_states[index] = self._seeded(int(seed))

    # ---------------------------------------------------------------------------------------------------- tensors
    def index_of(self, device) -> int:
        index = _get_device_index(device, optional=True)
        self.check_index(index)
        return index

    def wrap(self, out, index: int, stream: Stream, inputs: list, writer: Stream | None = None):
        """The op's tensor results as tensors on ``cuda:index`` (results that are inputs, as in-place ops return, are
        the same objects). A result in memory the stand-in has not seen is allocated and written by ``stream`` now;
        a view of known memory is only a view."""
        def one(t):
            if not isinstance(t, torch.Tensor) or any(t is x for x in inputs):
                return t
            if not isinstance(t, CudaTensor):
                with torch._C.DisableTorchFunction():
                    t = t.as_subclass(CudaTensor)
            t._index = index
            storage = t.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in self.blocks:
                if self.dirty.get(index) is stream:
                    raise Race(f"fake CUDA: memory allocated on {stream} after decode_jpeg failed part-way: "
                                       "the decoder's stream may still write into the outputs it freed there; "
                                       "torch.cuda.synchronize(device) first")
                self.blocks[storage.data_ptr()] = Block(stream, storage, self, writer)
                if self.captured is not None:
                    self.captured.made.add(storage.data_ptr())
            return t

        return tree_map(one, out)

    def access(self, stream: Stream, reads, writes=()):
        """One op on ``stream`` that reads the memory of the CUDA tensors ``reads`` and writes that of ``writes``: check
        that every earlier use of that memory on another stream is ordered before it (``ordered``), then note it."""
        self.raise_faults()
        stream.clock += 1
        for t, writing in [(t, False) for t in reads] + [(t, True) for t in writes]:
            block = self.blocks.get(t.untyped_storage().data_ptr()) if isinstance(t, CudaTensor) else None
            if block is None:
                continue
            uses = [("wrote", *block.writer)] + ([("reads", r, c) for r, c in block.reads.items()] if writing else [])
            for what, other, clock in uses:
                if other is not stream and not self.ordered(stream, other, clock):
                    raise Race(
                        f"fake CUDA: {stream} {'writes' if writing else 'reads'} memory that {other} {what} (its op "
                        f"{clock}) without waiting for it: record an event on {other} after that op and wait_event on "
                        "it, or synchronize")
            if writing:
                block.writer, block.reads = (stream, stream.clock), {}
            else:
                block.reads[stream] = stream.clock
            block.uses[stream] = stream.clock

    @staticmethod
    def ordered(stream: Stream, other: Stream, clock: int) -> bool:
        """Whether op ``clock`` of ``other`` has run before anything ``stream`` queues from now: ``stream`` waited for
        an event recorded after it, or the host waited for ``other`` since."""
        return max(stream.seen.get(other, 0), other.done) >= clock

    def freed(self, address: int):
        """The memory at ``address`` is freed.

        The caching allocator gives it back to the stream it was allocated on, for that stream's next allocation, at
        once. A use on another stream that that stream has not waited for, and that
        ``record_stream`` did not mark, may still run then, on memory handed to someone else."""
        block = self.blocks.pop(address, None)
        if block is None:
            return
        for other, clock in block.uses.items():
            if (other is not block.stream and other not in block.recorded
                    and not self.ordered(block.stream, other, clock)):
                self.faults.append(
                    f"fake CUDA: memory allocated on {block.stream} was used on {other} (its op {clock}) and freed "
                    f"without record_stream({other}) or {block.stream} waiting for that use: the caching allocator "
                    f"hands it to {block.stream}'s next allocation while {other} may still use it")

    def raise_faults(self):
        if self.faults:
            fault, self.faults = self.faults[0], []
            raise Race(fault)

    def run(self, func, args, kwargs):
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        indices = {t._index for t in tensors if isinstance(t, CudaTensor)}
        device = kwargs.get("device")
        if _is_cuda(device):  # a factory: torch.empty(..., device="cuda"), torch.rand(..., device=x.device), ...
            indices.add(self.index_of(device))
            kwargs = {**kwargs, "device": "cpu"}
        if not indices:
            if self.pinned:
                self.check_host_writes(func, args, kwargs)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and threading.current_thread() is threading.main_thread():
                self.largest_host_tensor = max(self.largest_host_tensor, out.nbytes)
            return out
        self.check_process()
        if len(indices) > 1:
            a, b = sorted(indices)[:2]
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:{a} and cuda:{b}!")
        (index,) = indices
        if getattr(func, "__name__", "") in _METADATA:
            out = func(*args, **kwargs)
            stream = self.current_stream(index)
            return self.wrap(out, index, stream, tensors)
        written = tree_flatten(args[0])[0] if args and (func is torch.Tensor.__setitem__ or _in_place(func)) else []
        written += [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []
        if func not in _CROSS_DEVICE:
            # a CPU scalar may be read by an element-wise kernel, never written; a foreach op's lists pair up their
            # tensors one by one: a CPU tensor it writes is refused where its partner is on the GPU
            outputs = written if not (args and isinstance(args[0], (list, tuple))) else _foreach_targets(func, args)
            for t in tensors:
                if not isinstance(t, CudaTensor) and (t.dim() > 0 or func in _NO_CPU_SCALARS
                                                      or any(t is w for w in outputs)):
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                       f"devices, cuda:{index} and cpu! ({getattr(func, '__name__', func)})")
        with self.lock:
            stream = self.current_stream(index)
            out = func(*args, **kwargs)
            written = [t for t in written if isinstance(t, CudaTensor)]
            # a view runs no kernel: it neither reads nor writes; a captured op runs nothing until replayed
            if (written or not _views_of(out, tensors)) and self.capturing is not stream:
                only_written = [kwargs.get("out"), *(args[:1] if getattr(func, "__name__", "") in _FILLS else ())]
                self.access(stream, [t for t in tensors if isinstance(t, CudaTensor)
                                     and not any(t is w for w in only_written)], written)
            if func in _SYNCING or _waits_for_host(func, args, device):
                self.host_waits(stream, why=getattr(func, "__name__", str(func)))
            if _is_cpu_device(device):
                return out
            out = self.wrap(out, index, stream, tensors)
            if self.capturing is stream:
                self.captured.tape.append((func, args, kwargs, out, bool(written) or _views_of(out, tensors)))
            return out

    def check_host_writes(self, func, args, kwargs):
        """A host op that writes page-locked memory a queued copy may still read raises ``Race``."""
        written = tree_flatten(args[0])[0] if args and (func is torch.Tensor.__setitem__ or _in_place(func)) else []
        written += [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []
        for t in written:
            if not isinstance(t, torch.Tensor):
                continue
            for stream, clock in self.pinned.get(t.untyped_storage().data_ptr(), ()):
                if stream.done < clock:
                    raise Race(f"fake CUDA: the host writes page-locked memory that a non_blocking copy queued on "
                               f"{stream} (its op {clock}) still reads: wait for an event recorded after that copy "
                               f"(query or synchronize) first")

    def replay(self, graph: CUDAGraph):
        """Run ``graph``'s recorded ops again on the current stream, into the tensors they made when captured."""
        index = self.current_device()
        stream = self.current_stream(index)
        with self.lock:
            reads, writes = [], []
            for func, args, kwargs, out, in_place in graph.tape:
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, CudaTensor) and t.untyped_storage().data_ptr() not in graph.made:
                        reads.append(t)
                writes += [t for t in tree_flatten(out)[0] if isinstance(t, CudaTensor)]
            self.access(stream, reads, writes)
            with torch._C.DisableTorchFunction(), torch.no_grad():  # a graph's kernels: no autograd
                for func, args, kwargs, out in graph.ops:
                    result = func(*args, **kwargs)
                    for kept, new in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                        if isinstance(kept, torch.Tensor) and not _same_memory(kept, new):
                            kept.copy_(new)
            self.replays += 1
            graph.replays += 1

    # ------------------------------------------------------------------------------------- what moves between devices
    def _copy(self, src: torch.Tensor, index: int | None, non_blocking: bool, into: torch.Tensor | None = None,
              **how) -> torch.Tensor:
        """``src`` on ``cuda:index`` (None: the CPU), as ``Tensor.to`` copies it; to a GPU, into ``into`` if given."""
        source = src._index if isinstance(src, CudaTensor) else None
        if index is not None:
            self.check_process()
            self.check_index(index)
        with self.lock:
            if source is not None:
                stream = self.current_stream(source)
                self.access(stream, [src])
            if index is None:  # to the host: waits for the copy unless non_blocking
                if non_blocking and source is not None:
                    raise RuntimeError("fake CUDA: a non_blocking copy to the CPU is not modelled (on CUDA its data is "
                                       "undefined until the host waits for the stream); copy with non_blocking=False")
                with torch._C.DisableTorchFunction():
                    out = src.as_subclass(torch.Tensor).to(copy=True, **how)
                if not non_blocking:
                    self.host_waits(self.current_stream(source), why="to the CPU")
                return out
            stream = self.current_stream(index)
            pinned = None if source is not None else self.pinned.get(src.untyped_storage().data_ptr())
            if source is None and non_blocking and pinned is None:
                # CUDA stages pageable memory synchronously: the host waits for the stream, then the copy is queued
                self.host_waits(stream, why="pageable to the GPU")
            with torch._C.DisableTorchFunction():
                out = src.as_subclass(torch.Tensor).to(copy=True, **how)
            if into is None:
                self.access(stream, [])
                out = self.wrap(out, index, stream, [])
            else:
                self.access(stream, [], [into])
                with torch._C.DisableTorchFunction():
                    into.copy_(out)
                out = into
            if source is None and not non_blocking:
                self.host_waits(stream, why="to the GPU")  # memcpy_and_sync: the host waits for the copy
            elif pinned is not None:
                pinned.append((stream, stream.clock))  # read when the copy runs
            if self.capturing is stream:
                raise RuntimeError("fake CUDA: a copy from the host inside a CUDA graph capture is not modelled")
            return out

    def copy_(self, dst: torch.Tensor, src, non_blocking: bool = False) -> torch.Tensor:
        """``dst.copy_(src)``: between devices it waits and refuses as ``_copy`` (``Tensor.to``) does, then writes
        ``dst`` on its device; within one device it is an op like any other."""
        there = dst._index if isinstance(dst, CudaTensor) else None
        here = src._index if isinstance(src, CudaTensor) else None
        if not isinstance(src, torch.Tensor) or here == there:
            return self.run(torch.Tensor.copy_, (dst, src), dict(non_blocking=non_blocking))
        if here is None:  # from the host: straight into dst, which the host then waits for unless non_blocking
            return self._copy(src, there, non_blocking, into=dst)
        return self.run(torch.Tensor.copy_, (dst, self._copy(src, there, non_blocking)), {})

    def to(self, tensor, *args, **kwargs):
        copy = kwargs.pop("copy", False)
        if args and isinstance(args[0], torch.Tensor):  # to(other): other's device as it says it is, and dtype
            args = (args[0].device, args[0].dtype, *args[1:])
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        how = {k: v for k, v in dict(dtype=dtype, memory_format=memory_format).items() if v is not None}
        here = tensor._index if isinstance(tensor, CudaTensor) else None
        there = here if device is None else (self.index_of(device) if device.type == "cuda" else None)
        if there == here:
            if here is None:
                with torch._C.DisableTorchFunction():
                    return torch.Tensor.to(tensor, *args, copy=copy, **kwargs)
            return self.run(torch.Tensor.to, (tensor,), dict(copy=copy, **how)) if how or copy else tensor
        return self._copy(tensor, there, non_blocking, **how)

    def cuda(self, tensor, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self.to(tensor, torch.device("cuda", self.index_of(device)), non_blocking=non_blocking,
                       memory_format=memory_format)

    def cpu(self, tensor, memory_format=torch.preserve_format):
        return self.to(tensor, "cpu", memory_format=memory_format)

    def pin_memory(self, tensor, device=None):
        if isinstance(tensor, CudaTensor):
            raise RuntimeError(f"cannot pin '{tensor.type()}' only dense CPU tensors can be pinned")
        with torch._C.DisableTorchFunction():
            pinned = tensor.clone().as_subclass(PinnedTensor)
        address = pinned.untyped_storage().data_ptr()
        self.pinned[address] = []
        weakref.finalize(pinned.untyped_storage(), self.pinned.pop, address, None).atexit = False
        return pinned

    def is_pinned(self, tensor, device=None) -> bool:
        return not isinstance(tensor, CudaTensor) and tensor.untyped_storage().data_ptr() in self.pinned

    def record_stream(self, tensor, stream):
        if not isinstance(stream, Stream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, not {type(stream).__name__}")
        if not isinstance(tensor, CudaTensor):
            raise NotImplementedError("Could not run 'aten::record_stream' with arguments from the 'CPU' backend")
        if stream.device_index != tensor._index:
            raise Race(f"fake CUDA: record_stream of a tensor on cuda:{tensor._index} with {stream}")
        block = self.blocks.get(tensor.untyped_storage().data_ptr())
        if block is not None:
            block.recorded.add(stream)

    def numpy(self, tensor, *, force=False):
        if isinstance(tensor, CudaTensor):
            raise TypeError(f"can't convert cuda:{tensor._index} device type tensor to numpy. Use Tensor.cpu() to copy "
                            "the tensor to host memory first.")
        with torch._C.DisableTorchFunction():
            return tensor.numpy(force=force)

    # ------------------------------------------------------------------------------------------------- JPEG decoders
    def use_decoders(self, *names: str):
        """Have ``data.decode`` decode JPEGs with these stand-ins, preferred in this order: "nvImageCodec",
        "TorchCodec", "torchvision"."""
        from bayesncl_pyro.data import decode

        fakes = {"nvImageCodec": decode.JpegDecoder("nvImageCodec (fake)", self.nvimgcodec_decode, torch_memory=False),
                 "TorchCodec": decode.JpegDecoder("TorchCodec (fake)", self.torchcodec_decode, torch_memory=True),
                 "torchvision": decode.JpegDecoder("torchvision (fake)", self.torchvision_decode, torch_memory=True)}
        self.monkeypatch.setattr(decode, "JPEG_DECODERS", [fakes[name] for name in names])

    def torchvision_decode(self, jpegs: list[torch.Tensor], device) -> list[torch.Tensor]:
        """torchvision's ``decode_jpeg``: on CUDA after the checks above (nvJPEG on a stream of its own)."""
        if not _is_cuda(device):
            return self.cpu_decode(jpegs, device)
        return self._own_stream_decode(jpegs, device)

    def torchcodec_decode(self, jpegs: list[torch.Tensor], device) -> list[torch.Tensor]:
        """TorchCodec's ``decode_jpeg`` (0.17): torchvision's, with the host waiting for the current stream before and
        for its own stream after."""
        if not _is_cuda(device):
            return self.cpu_decode(jpegs, device)
        self.host_waits(self.current_stream(self.index_of(device)), why="TorchCodec's decode_jpeg, before")
        return self._own_stream_decode(jpegs, device, wait_after=True)

    def _own_stream_decode(self, jpegs, device, wait_after: bool = False) -> list[torch.Tensor]:
        index = self._check_jpegs(jpegs, device)
        if self.backend != "native":
            raise Race("fake CUDA: nvJPEG writing PyTorch's memory from its own stream under the cudaMallocAsync "
                       "backend: its outputs may get memory other streams still use")
        stream = self.current_stream(index)
        if stream.clock > stream.done:
            raise Race(f"fake CUDA: a JPEG decoder that writes from its own stream called with work queued on {stream} "
                       "that the host has not waited for: nvJPEG writes its outputs, allocated on that stream, into "
                       "memory that work may still use")
        try:
            images = self.cpu_decode(jpegs, "cpu")
        except RuntimeError as err:  # decoding started: the decoder's stream may still write into what it freed
            self.dirty[index] = stream
            raise RuntimeError(f"Error while decoding JPEG images: {err}") from None
        own = self.decoder_streams.setdefault(index, Stream(index, name=f"a JPEG decoder's own stream on cuda:{index}"))
        self.access(own, [])
        images = [self.wrap(image, index, stream, [], writer=own) for image in images]
        if wait_after:
            self.host_waits(own, why="a JPEG decoder's own stream, after")
        stream.wait_stream(own)  # the current stream then waits for the decoder's
        return images

    def nvimgcodec_decode(self, jpegs: list[torch.Tensor], device) -> list[torch.Tensor]:
        """nvImageCodec's batched decode: its own memory, written in the current stream's order."""
        if not _is_cuda(device):
            return self.cpu_decode(jpegs, device)
        index = self._check_jpegs(jpegs, device)
        stream = self.current_stream(index)
        images = self.cpu_decode(jpegs, "cpu")
        self.access(stream, [])
        return [self.wrap(image, index, stream, []) for image in images]

    def _check_jpegs(self, jpegs, device) -> int:
        index = self.index_of(device)
        self.check_process()
        for data in jpegs:
            if data.dtype != torch.uint8:
                raise RuntimeError("Expected a torch.uint8 tensor")
            if isinstance(data, CudaTensor):
                raise RuntimeError("The input tensor must be on CPU when decoding with nvjpeg")
            if data.dim() != 1 or data.numel() == 0:
                raise RuntimeError("Expected a non empty 1-dimensional tensor")
        self.decodes += 1
        return index

    def cpu_decode(self, jpegs, device) -> list[torch.Tensor]:
        """The first installed decoder's, on the CPU."""
        with torch._C.DisableTorchFunction():
            return self.installed_decoders[0].decode([data.as_subclass(torch.Tensor) for data in jpegs], device)

    # -------------------------------------------------------------------------------------------------- installing
    def install(self, monkeypatch: pytest.MonkeyPatch):
        cuda, runtime = torch.cuda, self
        for name, value in dict(
            is_available=lambda: True, device_count=lambda: self.count, current_device=self.current_device,
            set_device=self.set_device, Stream=Stream, Event=Event, stream=_StreamContext,
            current_stream=self.current_stream, default_stream=lambda device=None: self.default_streams[
                self.index_of(device)], set_stream=self.set_stream, synchronize=self.synchronize,
            mem_get_info=lambda device=None: (self.free, self.total) if self.index_of(device) >= 0 else None,
            get_allocator_backend=lambda: self.backend, get_device_name=lambda device=None: "fake CUDA device",
            memory_allocated=lambda device=None: 0, max_memory_allocated=lambda device=None: 0,
            reset_peak_memory_stats=lambda device=None: None, is_bf16_supported=lambda *a, **k: True,
            is_current_stream_capturing=lambda: self.capturing is not None and self.current_stream() is self.capturing,
            CUDAGraph=CUDAGraph, graph=_GraphCapture, is_initialized=lambda: True, _lazy_init=lambda: None,
            get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state,
            get_rng_state_all=lambda: [self.get_rng_state(i) for i in range(self.count)],
            set_rng_state_all=lambda states: [self.set_rng_state(state, i) for i, state in enumerate(states)] and None,
            manual_seed=self.manual_seed, manual_seed_all=lambda seed: self.manual_seed(seed, all_devices=True),
        ).items():
            monkeypatch.setattr(cuda, name, value)
        # its argument parser takes a real torch.Stream only, before any torch function could see the call
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: self.record_stream(tensor, stream))
        acc = torch.accelerator  # what DataLoader's pin_memory asks
        monkeypatch.setattr(acc, "is_available", lambda: True)
        monkeypatch.setattr(acc, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        monkeypatch.setattr(acc, "current_device_index", self.current_device)
        monkeypatch.setattr(acc, "set_device_index", self.set_device)
        monkeypatch.setattr(acc, "device_count", lambda: self.count)
        monkeypatch.setattr(acc, "current_stream", self.current_stream)  # the optimizers' graph-capture check
        # autocast "cuda" casts what CUDA kernels get; the stand-in's tensors are CPU tensors, which CPU autocast casts
        monkeypatch.setattr(torch, "autocast", _Autocast)
        # nn.Module.to replaces each parameter by the moved tensor (a CudaTensor), instead of setting .data
        monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
        from bayesncl_pyro.data import decode

        self.monkeypatch, self.installed_decoders = monkeypatch, decode.JPEG_DECODERS
        self.use_decoders("TorchCodec", "torchvision")
        monkeypatch.setattr(decode, "_CANNOT", {})
        monkeypatch.setattr(decode, "_DECODE_STREAMS", {})
        monkeypatch.setattr(decode, "_HELD", collections.deque())
        from bayesncl_pyro.data import pipeline

        monkeypatch.setattr(pipeline, "_STREAMS", {})  # a stream of an earlier test's runtime is not one of ours
        run = threading.Thread.run

        def run_with_fake_cuda(thread):
            with _Mode(runtime):
                run(thread)

        monkeypatch.setattr(threading.Thread, "run", run_with_fake_cuda)


class _Autocast(torch.autocast):
    """``torch.autocast``, with "cuda" autocasting the CPU tensors that stand in for CUDA tensors."""

    def __init__(self, device_type: str, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _waits_for_host(func, args, device) -> bool:
    """Whether CUDA makes the host wait where this stand-in sees no copy: a factory of host data, an index held on
    the CPU (copied over synchronously), a boolean mask (its ``nonzero`` sizes the result), floating-point nested
    images padded (their sizes copied over synchronously)."""
    if func in _FROM_HOST:
        return _is_cuda(device) and not (args and isinstance(args[0], torch.Tensor))
    if func is torch.nested.to_padded_tensor:  # aten's NestedTensor_to_padded_tensor_cuda: metadata.to(kCUDA, kInt)
        return args[0].dtype in (torch.float16, torch.float32, torch.float64)
    if func in _CROSS_DEVICE and len(args) > 1:
        index = tree_flatten(args[1])[0]
        return any(isinstance(i, torch.Tensor) and (not isinstance(i, CudaTensor) and i.dim() > 0
                                                    or i.dtype == torch.bool) for i in index)
    return False


def _foreach_targets(func, args) -> list[torch.Tensor]:
    """The tensors an in-place foreach op writes whose partner (same position in another list, or the one tensor
    given for all) is a CUDA tensor; ``_foreach_copy_`` copies between devices."""
    name = getattr(func, "__name__", "")
    if not _in_place(func) or name == "_foreach_copy_":
        return []
    partners = [a if isinstance(a, (list, tuple)) else [a] * len(args[0])
                for a in args[1:] if isinstance(a, (list, tuple, torch.Tensor))]
    return [t for i, t in enumerate(args[0])
            if any(i < len(p) and isinstance(p[i], CudaTensor) for p in partners)]


def _views_of(out, inputs: list[torch.Tensor]) -> bool:
    """Whether ``out`` holds tensors and each lies in the memory of one of ``inputs`` (an input, or a view of one)."""
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    memory = {t.untyped_storage().data_ptr() for t in inputs}
    return bool(outputs) and all(t.untyped_storage().data_ptr() in memory for t in outputs)


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _is_cpu_device(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cpu"


@pytest.fixture
def fake_cuda(monkeypatch):
    """``count`` fake GPUs for the test's duration (``tests/fake_cuda.py``); yields the ``FakeCuda`` state."""
    global RUNTIME
    runtime = FakeCuda()
    runtime.install(monkeypatch)
    try:
        with _Mode(runtime):
            yield runtime
            gc.collect()  # what the test freed in reference cycles is freed now, and judged
            runtime.raise_faults()
    finally:
        RUNTIME = None
