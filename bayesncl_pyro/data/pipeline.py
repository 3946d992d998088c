"""The training steps' input, in an order that a resumed run replays.

``TrainingInput`` picks where the views are drawn and yields each step's 2B rows
[view 1; view 2] on the training device, in the order ``EpochSampler`` gives, so that a resumed run gets the inputs
of an uninterrupted one.

The views are drawn in DataLoader workers (per image, on the CPU: ``views.TwoViews``), or on the training device
(``--augment device``, and ``auto`` on CUDA and for in-memory sets), from one of two sources of images
(``resident.resident_images`` decides):

- ``ResidentViews``: the whole training set on the device as one uint8 ``N x C x H x W`` tensor (CIFAR is
  150 MB; image folders of small equal-size images are decoded once at start-up). A batch is a row of
  indices; no DataLoader, no decoding per step, and the crops of equal-size images resize in one product.
- ``FileViews``: DataLoader workers read the files' bytes into one ``EncodedBatch``, ``EncodedImages.decode``
  decodes the batch (nvJPEG on CUDA).

Both draw the views with ``device_views.BatchViews`` from a generator seeded by (seed, step, rank): a resumed run
draws the views it would have drawn, prefetched or not. On CUDA they come out in the step's dtype (bf16 under
autocast) and memory format (channels_last).

On CUDA the views are drawn a batch or two ahead, on the input pipeline's own CUDA stream. The handover follows
CUDA's stream semantics: the training stream waits for an event recorded after the batch's last kernel
(``wait_event``: on the GPU, the host does not wait). Neither the training thread nor the pipeline waits for the GPU.

- ``ResidentViews.replayed``: the views of a set held on the device are two CUDA graphs, replayed in turn on the
  pipeline's stream from the training thread itself (no thread: drawing a batch's parameters on the CPU is all the
  host does); each graph's output is rewritten only after the steps that read it (an event on the training stream).
- ``prefetch`` (files): a background thread decodes and draws; each batch is marked as used on the training
  stream (``record_stream``) so the caching allocator does not give its memory back to the pipeline's stream before
  the step that reads it has run.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from bayesncl_pyro.config import Config
from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages, no_jpeg_decoder
from bayesncl_pyro.data.device_views import BatchViews, ViewChain, ViewParams
from bayesncl_pyro.data.images import DataSpec, image_files
from bayesncl_pyro.data.resident import resident_images
from bayesncl_pyro.data.views import TwoViews, collate_views, simclr_transform
from bayesncl_pyro.errors import UserError

logger = logging.getLogger(__name__)

AHEAD = 2
"""Batches the prefetcher may hold ready on CUDA; one more is being drawn meanwhile, and the step holds its own."""


class TrainingInput:
    """The inputs of the training steps, and where their views are drawn.

    The steps are of ``data.train`` under ``cfg`` on ``device`` (rank ``rank`` of ``world``:
    its share of each global batch), and where their views are drawn (``views``): None, in the loader workers (per
    image, on the CPU); else on the device, in batches, of the training set held there when it fits (one size, small
    enough), else of the batch's files. ``--augment auto``: on the device when training on CUDA, whose GPU outpaces
    CPU workers, and for in-memory training sets (digits, CIFAR pickles, compositional) anywhere: on a CPU too,
    batched views of small images cost a fraction of the step, where per-image views in workers cost more than it.
    """

    def __init__(self, data: DataSpec, cfg: Config, device: torch.device, rank: int = 0, world: int = 1,
                 memory_format: torch.memory_format = torch.preserve_format):
        self.data, self.cfg, self.device, self.rank, self.world = data, cfg, device, rank, world
        self.memory_format = memory_format
        self.views: ResidentViews | FileViews | None = None
        files = image_files(data.train)
        if cfg.augment == "device" or (cfg.augment == "auto" and (device.type == "cuda" or files is None)):
            # what the step takes: bf16 under its autocast, which would convert float32 views in a pass of its own
            form = dict(dtype=torch.bfloat16 if device.type == "cuda" and cfg.amp else torch.float32,
                        memory_format=memory_format, compile=cfg.compile)
            resident = resident_images(data.train, device, cfg.workers)
            if resident is not None:
                self.views = ResidentViews(resident, cfg.image_size, cfg.seed, rank, **form)
            elif files is not None:
                why_not = no_jpeg_decoder(device)
                if why_not is not None and rank == 0:
                    logger.info(f"note: {why_not}; JPEGs are decoded in the loader workers instead")
                self.views = FileViews(EncodedImages(data.train, why_not is None), cfg.image_size, cfg.seed, rank,
                                       device, **form)
            elif cfg.augment == "device":
                raise UserError(f"--augment device: {cfg.dataset}'s training set does not fit in a quarter of the "
                                f"{device.type} memory free; use --augment workers")

    def batches(self, first: int, last: int) -> Iterator[torch.Tensor]:
        """Yield the inputs of steps ``first`` + 1 to ``last`` on the device.

        Each is 2B rows [view 1; view 2]. Views drawn
        on the device depend on (seed, step, rank) alone, so a resumed run draws the same ones; on CUDA they are
        drawn a batch ahead: for a set held there by CUDA graphs replayed from this thread, for files in the input
        pipeline's thread.
        """
        batch_size, per_epoch = self.cfg.batch_size, len(self.data.train) // self.cfg.batch_size
        sampler = EpochSampler(len(self.data.train), batch_size, self.cfg.seed, self.rank, self.world)
        loader = self.loader(sampler)
        step = first
        while step < last:
            sampler.set_epoch(*divmod(step, per_epoch))
            for x in self._on_device(loader, step):
                yield x
                step += 1
                if step == last:
                    return

    def loader(self, sampler: EpochSampler) -> Iterable:
        """What the steps' inputs are made of, in ``sampler``'s order.

        Index rows of the resident set, or a
        DataLoader of file bytes (``views``) or of views drawn in its workers.
        """
        cfg = self.cfg
        if isinstance(self.views, ResidentViews):  # the images are on the device already
            return self.views.batches(sampler, cfg.batch_size // self.world)
        if self.views is not None:  # workers only read files; _on_device decodes and augments
            dataset, collate = self.views.encoded, EncodedBatch
        else:
            dataset = TwoViews(self.data.train, simclr_transform(cfg.image_size, self.data.channels), cfg.seed)
            collate = collate_views
        # its own generator: creating an epoch's iterator must not draw from the global RNG, which
        # the gate samples use and the checkpoint restores. Pinned memory only for views: file bytes go to
        # the decoder from wherever they are
        return DataLoader(dataset, batch_size=cfg.batch_size // self.world, sampler=sampler, drop_last=True,
                          num_workers=cfg.workers, collate_fn=collate,
                          pin_memory=self.device.type == "cuda" and self.views is None,
                          persistent_workers=cfg.workers > 0, generator=torch.Generator(),
                          worker_init_fn=_ignore_sigint)

    def _on_device(self, loader: Iterable, first: int) -> Iterator[torch.Tensor]:
        """The steps' inputs from ``loader``'s items, its k-th the input of step ``first`` + k + 1."""
        if self.views is None:
            return (batch.to(self.device, non_blocking=True, memory_format=self.memory_format) for batch in loader)
        if isinstance(self.views, ResidentViews) and self.device.type == "cuda":
            return self.views.replayed(loader, first)
        return prefetch(loader, lambda batch, k: self.views(batch, first + k), self.device,
                        AHEAD if self.device.type == "cuda" else 0)


class EpochSampler(Sampler):
    """A permutation of the training set that depends only on (seed, epoch).

    Started at batch ``start``:
    resuming mid-epoch replays exactly the remaining batches of the interrupted epoch. Yields
    ``epoch * n + i`` so that ``TwoViews`` can seed each item's augmentations by epoch and item.
    Under DDP rank r of W takes the r-th slice (batch_size / W items) of every global batch, so the
    ranks together see the batches of a single-process run.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world = rank, world
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0):
        """Start epoch ``epoch`` at batch ``start_batch``."""
        self.epoch, self.start = epoch, start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        whole = self.n // self.batch_size * self.batch_size  # the last, partial batch is dropped
        order = torch.randperm(self.n, generator=g)[self.start * self.batch_size:whole]
        order = order.view(-1, self.world, self.batch_size // self.world)[:, self.rank].reshape(-1)
        return iter((order + self.epoch * self.n).tolist())

    def __len__(self):
        return (self.n // self.batch_size - self.start) * (self.batch_size // self.world)


def _ignore_sigint(worker_id: int):
    # Ctrl-C reaches the whole process group: workers keep serving batches while the main process
    # finishes the step and checkpoints (they end with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def view_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The CPU generator of the views of training step ``step`` on rank ``rank``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


class ResidentViews:
    """Views of a training set held on the device.

    ``views(indices, step)``, ``indices`` a CPU long tensor; on CUDA
    ``replayed`` draws a whole epoch's from CUDA graphs. Out in ``dtype`` and ``memory_format``; ``compile``: the
    views' chain is compiled (``torch.compile``) before it is captured.
    """

    def __init__(self, images: torch.Tensor, image_size: int, seed: int, rank: int = 0,
                 dtype: torch.dtype = torch.float32, memory_format: torch.memory_format = torch.preserve_format,
                 compile: bool = False):
        self.images, self.image_size, self.seed, self.rank = images, image_size, seed, rank
        self.form = dict(dtype=dtype, memory_format=memory_format)
        self.compile = compile
        self.drawn: dict[int, BatchViews] = {}  # batch size -> its views
        self.graphed: dict[int, _GraphedViews] = {}  # batch size -> its graphs (CUDA)

    def batches(self, sampler: Iterable[int], batch_size: int) -> IndexBatches:
        """The sampler's indices in rows of ``batch_size`` (``IndexBatches``)."""
        return IndexBatches(sampler, batch_size, len(self.images))

    def __call__(self, indices: torch.Tensor, step: int) -> torch.Tensor:
        """The views of rows ``indices`` of the held set, drawn from (seed, step, rank)."""
        if len(indices) not in self.drawn:
            self.drawn[len(indices)] = BatchViews(len(indices), self.image_size, self.images.shape[1],
                                                  self.images.device, rows=True, compile=self.compile, **self.form)
        return self.drawn[len(indices)](self.images, view_generator(self.seed, step, self.rank), indices)

    def _sizes(self, n: int) -> torch.Tensor:
        return torch.tensor([self.images.shape[-2:]], dtype=torch.float64).expand(n, 2)

    def replayed(self, batches: Iterable[torch.Tensor], first: int) -> Iterator[torch.Tensor]:
        """On CUDA, the views of ``batches`` replayed from CUDA graphs, a batch ahead.

        ``batches`` are index rows, the k-th those of step ``first`` + k + 1 (the same draws as
        ``views(indices, step)``): each batch is the replay of one of two CUDA graphs on the pipeline's stream, queued
        a batch ahead of the step that takes it, from this thread. A batch's tensor is rewritten two batches later:
        it is valid until the batch after it has been taken. When the iteration ends, each stream waits for the other
        (on the GPU): the last replays read the set, maybe never taken; the last steps read the graphs' memory, which
        goes back to the pipeline's stream when the graphs are freed.
        """
        training = torch.cuda.current_stream(self.images.device)
        side = _stream(self.images.device)
        ahead = None
        try:
            for k, indices in enumerate(batches):
                if len(indices) not in self.graphed:  # captured once, for every epoch
                    self.graphed[len(indices)] = _GraphedViews(self, len(indices), side)
                graphs = self.graphed[len(indices)]
                # every step so far has been queued, the one that read this graph's output two batches ago included
                ready = graphs.launch(k % 2, indices, view_generator(self.seed, first + k, self.rank),
                                      training.record_event())
                if ahead is not None:
                    yield _taken(*ahead, training)
                ahead = graphs.outputs[k % 2], ready
            if ahead is not None:
                yield _taken(*ahead, training)
        finally:
            training.wait_stream(side)
            side.wait_stream(training)


def _taken(x: torch.Tensor, ready: torch.cuda.Event, training: torch.cuda.Stream) -> torch.Tensor:
    training.wait_event(ready)  # the GPU waits, not the host
    return x


class _GraphedViews:
    """The views of ``n`` rows of the held set as two CUDA graphs.

    Each graph writes its own output; the parameters are
    drawn on the CPU (``ViewParams``), their jitter order read on the device (a static chain).
    """

    def __init__(self, resident: ResidentViews, n: int, side: torch.cuda.Stream):
        images = resident.images
        self.side = side
        self.params = ViewParams(n, resident.image_size, images.shape[1], images.device, rows=True)
        for host in self.params.host:  # once: the set's images are all of its size
            host["sizes"].copy_(resident._sizes(n))
        chain = ViewChain(resident.image_size, images.shape[1], images.device, static=True, **resident.form)
        p = self.params.device

        def views():
            return chain(images.index_select(0, p["rows"]), p)

        run = torch.compile(views, fullgraph=True, dynamic=False) if resident.compile else views
        side.wait_stream(torch.cuda.current_stream(images.device))  # the set was written on the training stream
        with torch.cuda.stream(side):
            self.params.draw(torch.Generator().manual_seed(0), rows=torch.zeros(n, dtype=torch.long))
            self.params.to_device()
            run()  # once outside the capture: libraries' handles and workspaces, the compilation
            self.graphs, self.outputs = [], []
            for _ in range(2):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    self.outputs.append(run())
                self.graphs.append(graph)

    def launch(self, slot: int, indices: torch.Tensor, generator: torch.Generator, after: torch.cuda.Event
               ) -> torch.cuda.Event:
        """Replay graph ``slot`` on the views of rows ``indices`` once the GPU has passed ``after``.

        The parameters are
        drawn here, on the CPU, and copied over on the pipeline's stream; an event recorded after the replay.
        """
        self.params.draw(generator, rows=indices)
        self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            self.params.to_device()
            self.graphs[slot].replay()
            return self.side.record_event()


class IndexBatches:
    """A sampler's indices in rows of ``batch_size``, taken mod ``n``.

    The indices run past ``n`` to encode the epoch (``EpochSampler``); a last, shorter row is dropped, as the DataLoader
    does with ``drop_last``.
    """

    def __init__(self, sampler: Iterable[int], batch_size: int, n: int):
        self.sampler, self.batch_size, self.n = sampler, batch_size, n

    def __iter__(self) -> Iterator[torch.Tensor]:
        indices = torch.tensor(list(self.sampler), dtype=torch.long) % self.n
        return iter(indices[:len(indices) // self.batch_size * self.batch_size].split(self.batch_size))

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


class FileViews:
    """Views of image files decoded on the device.

    ``views(batch, step)``, ``batch`` an ``EncodedBatch`` of ``EncodedImages`` items, decoded
    on the device and drawn from one padded batch (``device_views.padded_batch``). Out in ``dtype`` and
    ``memory_format``; ``compile``: the views' chain is compiled (``torch.compile``, static shapes: one compilation
    per padded shape).
    """

    def __init__(self, encoded: EncodedImages, image_size: int, seed: int, rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, memory_format: torch.memory_format = torch.preserve_format,
                 compile: bool = False):
        self.encoded, self.image_size, self.seed, self.rank, self.device = encoded, image_size, seed, rank, device
        self.form = dict(dtype=dtype, memory_format=memory_format, compile=compile)
        self.drawn: dict[int, BatchViews] = {}  # batch size -> its views

    def __call__(self, batch: EncodedBatch, step: int) -> torch.Tensor:
        """The views of ``batch``, decoded and drawn on the device from (seed, step, rank)."""
        if len(batch) not in self.drawn:
            self.drawn[len(batch)] = BatchViews(len(batch), self.image_size, 3, self.device, **self.form)
        return self.drawn[len(batch)](self.encoded.decode(batch, self.device),
                                      view_generator(self.seed, step, self.rank))


def prefetch(batches: Iterable, make: Callable[[Any, int], torch.Tensor], device: torch.device,
             ahead: int = AHEAD) -> Iterator[torch.Tensor]:
    """``make(batch, k)`` for the k-th of ``batches``, in order, optionally made ahead in a thread.

    With ``ahead`` > 0 they are made in a background
    thread (on its own stream on CUDA), at most ``ahead`` ahead of the consumer; with 0, here, when asked.

    The thread ends with the iteration, also when the consumer stops early (``break``, an exception: the
    generator's ``finally``), and an exception raised in it is raised here, to the consumer.
    """
    if ahead == 0:
        for k, batch in enumerate(batches):
            yield make(batch, k)
        return
    worker = _Prefetcher(batches, make, device, ahead)
    try:
        yield from worker
    finally:
        worker.close()


_END = object()
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The input pipeline's stream on ``device``, one for the process.

    The caching allocator keeps freed blocks
    per stream, so a new stream per epoch would cache another copy of the pipeline's working memory. It comes from
    PyTorch's stream pool, whose streams other users (torchvision's decoder, NCCL) may draw too: sharing one only
    serialises their work. Being non-blocking, it does not wait for the legacy default stream, nor it for it: only
    the event below orders them.
    """
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class _Prefetcher:
    def __init__(self, batches: Iterable, make: Callable, device: torch.device, ahead: int):
        self.device, self.queue, self.stop = device, queue.Queue(ahead), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(batches, make), name="input-pipeline", daemon=True)
        self.thread.start()

    def _run(self, batches: Iterable, make: Callable):
        try:
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
            stream = _stream(self.device) if cuda else None
            with torch.cuda.stream(stream):  # None: a no-op
                for k, batch in enumerate(batches):
                    x = make(batch, k)
                    done = None
                    if cuda:  # one event per batch: a wait is for an event's latest record, so an event shared by
                        # the batches, once recorded for the next one, would hold the step back until that is drawn too
                        done = torch.cuda.Event()
                        done.record(stream)
                    if not self._put((x, done)):
                        return
        except BaseException as err:  # noqa: BLE001 -- whatever it is, the consumer raises it
            self._put(err)
            return
        self._put(_END)

    def _put(self, item) -> bool:
        """Queue ``item`` unless the consumer has stopped listening; whether it was queued."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            item = self.queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            x, done = item
            if done is not None:
                training = torch.cuda.current_stream(self.device)
                training.wait_event(done)  # the GPU waits, not the host
                x.record_stream(training)  # freed later: its block waits for the steps that read it
            yield x

    def close(self):
        self.stop.set()
        self.thread.join()
        if self.device.type == "cuda":
            # batches drawn ahead and never taken read memory of the training stream's (a resident set): it waits for
            # them (on the GPU), so that freeing or rewriting that memory later cannot overtake them
            torch.cuda.current_stream(self.device).wait_stream(_stream(self.device))
