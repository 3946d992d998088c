"""The training step's input when the views are drawn on the training device (``--augment device``, and ``auto``
on CUDA): where a batch's images come from, and a prefetcher that draws the next batch while a step runs.

Two sources of images (``Trainer`` picks one, ``resident.resident_images`` decides):

- ``ResidentViews``: the whole training set on the device as one uint8 ``N x C x H x W`` tensor (CIFAR is
  150 MB; image folders of small equal-size images are decoded once at start-up). A batch is a row of
  indices; no DataLoader, no decoding per step, and the crops of equal-size images resize in one product.
- ``FileViews``: DataLoader workers read the files' bytes into one ``EncodedBatch``, ``EncodedImages.decode``
  decodes the batch (nvJPEG on CUDA).

Both draw the views with ``device_views.simclr_views`` from a generator seeded by (seed, step, rank):
a resumed run draws the views it would have drawn, prefetched or not.

``prefetch`` runs them a batch or two ahead in a background thread with its own CUDA stream. The handover
follows CUDA's stream semantics: the training stream waits for an event recorded after the batch's
last kernel (``wait_event``: on the GPU, the host does not wait), and the batch is marked as used on the
training stream (``record_stream``) so the caching allocator does not give its memory back to the
pipeline's stream before the step that reads it has run. The pipeline's thread may wait for its own
stream (decoding does, ``decode._decode``); the training thread never waits for the pipeline's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages
from bayesncl_pyro.data.device_views import _to_device, simclr_views

AHEAD = 2
"""Batches the prefetcher may hold ready on CUDA; one more is being drawn meanwhile, and the step holds its own."""


def view_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The CPU generator of the views of training step ``step`` on rank ``rank``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


class ResidentViews:
    """Views of a training set held on the device: ``views(indices, step)``, ``indices`` a CPU long tensor."""

    def __init__(self, images: torch.Tensor, image_size: int, seed: int, rank: int = 0):
        self.images, self.image_size, self.seed, self.rank = images, image_size, seed, rank

    def batches(self, sampler: Iterable[int], batch_size: int) -> IndexBatches:
        return IndexBatches(sampler, batch_size, len(self.images))

    def __call__(self, indices: torch.Tensor, step: int) -> torch.Tensor:
        (rows,) = _to_device([indices], self.images.device)
        return simclr_views(self.images.index_select(0, rows), self.image_size,
                            view_generator(self.seed, step, self.rank), self.images.shape[1])


class IndexBatches:
    """A sampler's indices (which run past ``n`` to encode the epoch, ``EpochSampler``) in rows of ``batch_size``,
    taken mod ``n``; a last, shorter row is dropped, as the DataLoader does with ``drop_last``."""

    def __init__(self, sampler: Iterable[int], batch_size: int, n: int):
        self.sampler, self.batch_size, self.n = sampler, batch_size, n

    def __iter__(self) -> Iterator[torch.Tensor]:
        indices = torch.tensor(list(self.sampler), dtype=torch.long) % self.n
        return iter(indices[:len(indices) // self.batch_size * self.batch_size].split(self.batch_size))

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


class FileViews:
    """Views of image files: ``views(batch, step)``, ``batch`` an ``EncodedBatch`` of ``EncodedImages`` items."""

    def __init__(self, encoded: EncodedImages, image_size: int, seed: int, rank: int, device: torch.device):
        self.encoded, self.image_size, self.seed, self.rank, self.device = encoded, image_size, seed, rank, device

    def __call__(self, batch: EncodedBatch, step: int) -> torch.Tensor:
        return simclr_views(self.encoded.decode(batch, self.device), self.image_size,
                            view_generator(self.seed, step, self.rank))


def prefetch(batches: Iterable, make: Callable[[Any, int], torch.Tensor], device: torch.device,
             ahead: int = AHEAD) -> Iterator[torch.Tensor]:
    """``make(batch, k)`` for the k-th of ``batches``, in order. With ``ahead`` > 0 they are made in a background
    thread (on its own stream on CUDA), at most ``ahead`` ahead of the consumer; with 0, here, when asked.

    The thread ends with the iteration, also when the consumer stops early (``break``, an exception: the
    generator's ``finally``), and an exception raised in it is raised here, to the consumer."""
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
    """The input pipeline's stream on ``device``, one for the process: the caching allocator keeps freed blocks
    per stream, so a new stream per epoch would cache another copy of the pipeline's working memory. It comes from
    PyTorch's stream pool, whose streams other users (torchvision's decoder, NCCL) may draw too: sharing one only
    serialises their work. Being non-blocking, it does not wait for the legacy default stream, nor it for it: only
    the event below orders them."""
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
