"""The CUDA-only lines, run on a CPU through the stand-in of tests/fake_cuda.py: the training device, the prefetcher's
stream hand-off, the views of a set held on the GPU as CUDA graphs, the parameters' pinned buffers, GPU decoding and
its fallback, the training set held on the GPU, the training step's host syncs and divergence guard (which these
tests also run on the CPU), and the step as a CUDA graph."""

import collections
import gc
import logging
import runpy
import threading
from pathlib import Path

import pyro
import pytest
import torch
from fake_cuda import CudaTensor, Event, PinnedTensor, Race, Stream
from helpers import assert_resume_is_exact, photo_tree, truncate, write_photo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bayesncl_pyro import distributed
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset, pipeline
from bayesncl_pyro.data import resident as resident_module
from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages
from bayesncl_pyro.data.device_views import ViewParams
from bayesncl_pyro.data.resident import resident_images
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.train.graph import StepGraph
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _digits(tmp_path, name="run", **kw) -> Config:
    return Config(**{**dict(dataset="digits", proj_hidden=16, proj_dim=8, batch_size=64, epochs=2, warmup_epochs=0,
                            workers=0, log_every=1, train_subset=192, device="cuda", augment="device",
                            out=str(tmp_path / name)), **kw})


# ------------------------------------------------------------------------------------------------ the stand-in itself


def test_the_stand_in_checks_arguments_as_cuda_does(fake_cuda):
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_device(torch.device("cuda"))  # what every one-GPU run died of at its first batch
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.current_stream(torch.device("cpu"))
    x = torch.ones(4, device="cuda:1")
    assert x.device == CUDA1 and x.is_cuda and isinstance(x, CudaTensor)
    with pytest.raises(RuntimeError, match="found at least two devices, cuda:1 and cpu"):
        x + torch.ones(4)
    assert (x + torch.tensor(2.0)).device == CUDA1  # a CPU scalar is fine
    with pytest.raises(RuntimeError, match="cuda:0 and cuda:1"):
        x + torch.ones(4, device="cuda:0")
    with pytest.raises(TypeError, match="can't convert cuda:1 device type tensor to numpy"):
        x.numpy()
    assert x.cpu().tolist() == [1.0] * 4

    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        torch.ones(2).record_stream(torch.cuda.current_stream(0))
    with pytest.raises(Race, match="record_stream of a tensor on cuda:1"):
        x.record_stream(torch.cuda.current_stream(0))
    with pytest.raises(TypeError, match="must be Stream"):
        x.record_stream(None)

    side = Stream(1)
    with pytest.raises(Race, match="never recorded"):
        side.wait_event(Event())
    event = Event()
    event.record(side)
    with pytest.raises(RuntimeError, match="Event device index 1 does not match recording stream's device index 0"):
        event.record(torch.cuda.current_stream(0))


def test_the_stand_in_takes_a_cpu_scalar_only_as_an_element_wise_input(fake_cuda):
    x, scalar = torch.ones(3, device="cuda:0"), torch.tensor(2.0)
    assert torch.where(x > 0, x, scalar).device == CUDA0  # read by an element-wise kernel: fine
    for written_into_cpu_scalar in (lambda: torch.where(x[0] > 0, scalar, scalar, out=scalar),
                                    lambda: scalar.add_(x[0]), lambda: torch.mul(x[0], 2, out=scalar),
                                    lambda: torch._foreach_add_([scalar], [x[0]]),  # a CPU step count, a GPU grad
                                    lambda: torch._foreach_mul_([scalar], x[0])):
        with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
            written_into_cpu_scalar()
    for joined in (torch.cat, torch.stack):
        with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
            joined([x[:1], scalar.view(1)] if joined is torch.cat else [x[0], scalar])


def test_the_stand_in_keeps_an_rng_state_per_device(fake_cuda):
    state = torch.arange(16, dtype=torch.uint8)
    torch.cuda.set_rng_state(state, CUDA1)
    assert torch.equal(torch.cuda.get_rng_state(1), state) and not torch.equal(torch.cuda.get_rng_state(0), state)
    assert len(torch.cuda.get_rng_state_all()) == 2
    torch.cuda.set_device(1)
    assert torch.equal(torch.cuda.get_rng_state(), state)  # "cuda": the current device's
    with pytest.raises(IndexError):
        torch.cuda.get_rng_state(2)
    with pytest.raises(IndexError):
        torch.cuda.set_rng_state_all([state] * 3)  # a state for each of 3 GPUs where 2 are visible
    assert torch.accelerator.current_stream().is_capturing() is False


def _on(stream, op):
    with torch.cuda.stream(stream):
        return op()


def test_the_stand_in_orders_every_use_of_memory_across_streams(fake_cuda):
    """Each rule both ways: a read after a write, a write after a read, a write after a write, on another stream
    without waiting is refused; the same after a wait_stream (an event) or a host synchronize passes."""
    torch.cuda.set_device(1)
    side, main = Stream(1), torch.cuda.current_stream(1)
    y = _on(side, lambda: torch.ones(3, device="cuda") * 2)
    assert torch.cuda.current_stream() is main
    with pytest.raises(Race, match="reads memory that .* wrote .* without waiting for it"):
        y + 1
    main.wait_stream(side)
    z = y + 1  # main reads y
    with pytest.raises(Race, match="writes memory that .* reads .* without waiting for it"):
        _on(side, lambda: y.add_(1))
    side.wait_stream(main)
    _on(side, lambda: y.add_(1))
    with pytest.raises(Race, match="writes memory that .* wrote .* without waiting for it"):
        y.fill_(5)
    torch.cuda.synchronize()
    y.fill_(5)
    assert y.tolist() == [5.0] * 3 and z.tolist() == [3.0] * 3
    third = Stream(1)
    w = _on(third, lambda: torch.ones(2, device="cuda") + 0)
    side.wait_stream(third)
    main.wait_stream(side)  # after side, which had waited for third: after third too, as on CUDA
    assert (w + 1).tolist() == [2.0, 2.0]


def test_the_stand_in_sees_a_write_through_a_view_and_takes_a_view_for_no_kernel(fake_cuda):
    side, main = Stream(0), torch.cuda.current_stream(0)
    x = torch.zeros(4, device="cuda")
    side.wait_stream(main)
    _on(side, lambda: x[:2].fill_(1))  # writes x's memory through a view
    with pytest.raises(Race, match="reads memory that .* wrote"):
        x.sum()
    main.wait_stream(side)
    assert x.sum().item() == 2
    z = _on(side, lambda: torch.ones(3, device="cuda") + 0)
    view = z[1:].view(2, 1).t()  # views run no kernel: no wait needed to make them (CUDA's rule)
    with pytest.raises(Race, match="reads memory that .* wrote"):
        view + 1  # a kernel that reads it does need one


@pytest.mark.parametrize("made_safe", [None, "record_stream", "wait_stream", "synchronize"])
def test_the_stand_in_catches_memory_freed_while_another_stream_may_use_it(fake_cuda, made_safe):
    """The caching allocator hands a freed block to the next allocation on the stream it was allocated on, at once:
    memory read on another stream must be marked (record_stream), or its stream must wait for that use, first."""
    side, main = Stream(0), torch.cuda.current_stream(0)
    x = _on(side, lambda: torch.ones(1000, device="cuda") + 0)  # in the side stream's pool
    main.wait_stream(side)
    y = x * 2  # read on the main stream
    if made_safe == "record_stream":
        x.record_stream(main)
    elif made_safe == "wait_stream":
        side.wait_stream(main)
    elif made_safe == "synchronize":
        torch.cuda.synchronize()
    del x
    if made_safe is None:
        with pytest.raises(Race, match="freed without record_stream"):
            y + 1  # the next op reports it
    assert (y + 1).tolist() == [3.0] * 1000


def test_the_stand_in_counts_host_syncs_and_keeps_the_device_per_thread(fake_cuda):
    torch.cuda.set_device(1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_device()), name="probe")
    thread.start()
    thread.join()
    assert seen == [0]  # CUDA's current device is per thread: a new thread starts on 0
    before = fake_cuda.syncs["MainThread"]
    pinned = torch.ones(3).pin_memory()
    assert isinstance(pinned, PinnedTensor) and pinned.is_pinned()
    pinned.to("cuda", non_blocking=True)
    assert fake_cuda.syncs["MainThread"] == before  # from pinned memory: queued, not waited for
    torch.ones(3).to("cuda", non_blocking=True)  # pageable memory: CUDA stages it synchronously
    bool(torch.ones(1, device="cuda"))
    assert fake_cuda.syncs["MainThread"] == before + 2
    # the waits CUDA adds where no copy is written: host data made a device tensor, an index held on the CPU
    # (copied over synchronously), a boolean mask (its nonzero sizes the result); a device index does not wait
    x = torch.arange(4.0, device="cuda")
    before = fake_cuda.syncs["MainThread"]
    x[torch.arange(2, device="cuda")] = 1.0
    x[torch.arange(2, device="cuda")] + 1
    assert fake_cuda.syncs["MainThread"] == before
    torch.tensor([1.0, 2.0], device="cuda")
    x[torch.tensor([0, 1])]
    x[torch.tensor([0, 1])] = 0.0
    x[x > 1]
    assert fake_cuda.syncs["MainThread"] == before + 4
    with pytest.raises(RuntimeError, match="non_blocking copy to the CPU is not modelled"):
        x.to("cpu", non_blocking=True)  # readable only after a wait on CUDA: the stand-in refuses to guess
    # copy_ between devices follows the same rules as to()
    before = fake_cuda.syncs["MainThread"]
    x.copy_(torch.ones(4).pin_memory(), non_blocking=True)
    assert fake_cuda.syncs["MainThread"] == before
    x.copy_(torch.ones(4))
    torch.zeros(4).copy_(x)
    assert fake_cuda.syncs["MainThread"] == before + 2
    with pytest.raises(RuntimeError, match="non_blocking copy to the CPU is not modelled"):
        torch.zeros(4).copy_(x, non_blocking=True)


def test_the_stand_in_guards_pinned_memory_until_its_copy_has_run(fake_cuda):
    """A non_blocking copy from page-locked memory reads it when the copy runs: the host may write it again once it
    knows the copy has run (an event after it that a query found passed, or a wait), not before. Views count."""
    buffer = torch.zeros(8).pin_memory()
    part = buffer[2:6]
    assert part.is_pinned() and not torch.zeros(2).is_pinned()
    part.to("cuda", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    with pytest.raises(Race, match="writes page-locked memory that a non_blocking copy .* still reads"):
        buffer[3:5].uniform_()
    fake_cuda.lagging = True  # the GPU has not got there yet: the query says so, and the host must wait
    assert not copied.query()
    copied.synchronize()
    buffer.uniform_()
    fake_cuda.lagging = False
    part.to("cuda", non_blocking=True)
    event = torch.cuda.current_stream().record_event()
    before = fake_cuda.syncs["MainThread"]
    assert event.query()  # passed: the host knows it without waiting
    buffer.uniform_()
    assert fake_cuda.syncs["MainThread"] == before


def test_the_stand_in_replays_a_captured_graph_into_the_same_tensors(fake_cuda):
    """Capture records the ops run on the capturing stream; replay runs them again, on the current stream, reading the
    inputs as they are then and writing the tensors captured; a host sync while capturing fails as on CUDA."""
    side = Stream(0)
    x = torch.ones(3, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            pass
    with torch.cuda.graph(graph, stream=side):
        assert torch.cuda.is_current_stream_capturing()
        y = (x * 2).add_(1)
        z = y[:2].sum()
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            z.item()
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.current_stream().wait_stream(side)
    assert (y.tolist(), z.item()) == ([3.0] * 3, 6.0)
    x.fill_(5)
    with pytest.raises(Race, match="reads memory that .* wrote"):  # the replay's stream must wait for x's write
        with torch.cuda.stream(side):
            graph.replay()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.replay()
    torch.cuda.synchronize()
    assert (y.tolist(), z.item()) == ([11.0] * 3, 22.0)


# -------------------------------------------------------------------------------------------------- the device


def test_a_one_gpu_run_trains_from_its_first_batch_and_resumes_exactly(fake_cuda, tmp_path):
    """--device cuda was passed on without an index, and the input pipeline's thread died on set_device at step 1."""
    straight = Trainer(_digits(tmp_path, "a"), progress=False)
    assert_resume_is_exact(straight, lambda **kw: _digits(tmp_path, "b", **kw))
    assert straight.device == CUDA0 and pipeline._STREAMS.keys() == {CUDA0}  # the graphs' stream
    assert isinstance(straight.input.views, pipeline.ResidentViews) and straight.input.views.images.device == CUDA0
    assert straight.memory_format == torch.channels_last
    assert all(p.device == CUDA0 for p in straight.learner.parameters())


def test_the_device_is_resolved_once_with_its_index(fake_cuda, monkeypatch):
    torch.cuda.set_device(1)
    assert pick_device("cuda") == CUDA1 == pick_device("auto") == pick_device("cuda:1")
    assert pick_device("cuda:0") == CUDA0 and pick_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match=r"--device cuda:2: PyTorch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        pick_device("cuda:2")
    with pytest.raises(UserError, match="unknown --device gpu; choose one of"):
        pick_device("gpu")
    # under torchrun each process takes its own GPU; naming one GPU is refused
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("cuda") == CUDA0 == pick_device("auto")
    with pytest.raises(UserError, match="torchrun starts one process per GPU"):
        pick_device("cuda:1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    assert distributed.setup(CUDA0) == (0, 2, CUDA0) and torch.cuda.current_device() == 0


def test_a_run_on_the_second_gpu_keeps_everything_there(fake_cuda, tmp_path):
    trainer = Trainer(_digits(tmp_path, device="cuda:1"), progress=False)
    assert trainer.device == CUDA1 and torch.cuda.current_device() == 1
    trainer.train(3)  # a tensor on cuda:0 meeting one on cuda:1 would raise
    assert pipeline._STREAMS.keys() == {CUDA1} and torch.cuda.current_device() == 1
    assert all(p.device == CUDA1 for p in trainer.learner.parameters())


def test_a_file_run_on_the_second_gpu_draws_its_views_there(fake_cuda, tmp_path):
    """The input pipeline's thread starts on device 0, as every new thread does: it sets the training device."""
    photo_tree(tmp_path / "data")
    trainer = Trainer(Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=16,
                             proj_hidden=16, proj_dim=8, batch_size=4, epochs=1, warmup_epochs=0, workers=0,
                             device="cuda:1", augment="device", out=str(tmp_path / "run")), progress=False)
    trainer.train(2)
    assert isinstance(trainer.input.views, pipeline.FileViews) and ("input-pipeline", 1) in fake_cuda.set_devices


def test_the_cuda_random_stream_continues_on_whichever_gpu_resumes(fake_cuda, tmp_path, caplog):
    """Every visible GPU's state was saved and restored by index: a resume on another GPU got another GPU's stream, one
    where fewer GPUs are visible raised IndexError."""
    drawn = torch.arange(16, dtype=torch.uint8)  # the state of cuda:1's stream after the run's draws
    first = Trainer(_digits(tmp_path, device="cuda:1", max_steps=2), progress=False)
    first.train(2)
    torch.cuda.set_rng_state(drawn, CUDA1)
    first.save()
    fake_cuda.count = 1  # resumed where one GPU is visible
    resumed = Trainer(_digits(tmp_path, device="cuda:0"), progress=False)
    assert resumed.step == 2 and torch.equal(torch.cuda.get_rng_state(CUDA0), drawn)

    # a checkpoint of an older version holds the states of every GPU its process saw: this device's index is taken
    path = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    other = torch.full((16,), 7, dtype=torch.uint8)
    state["rng"][0]["cuda"] = [other, drawn]
    torch.save(state, path)
    fake_cuda.count = 2
    Trainer(_digits(tmp_path, device="cuda:1"), progress=False)
    assert torch.equal(torch.cuda.get_rng_state(CUDA1), drawn) and "random stream" not in caplog.text
    state["rng"][0]["cuda"] = [other]  # none for cuda:1: its stream restarts, and the user is told
    torch.save(state, path)
    Trainer(_digits(tmp_path, device="cuda:1"), progress=False)
    assert not torch.equal(torch.cuda.get_rng_state(CUDA1), other)
    assert "holds the CUDA random states of 1 GPU(s), none for cuda:1" in caplog.text


# ---------------------------------------------------------------------------------------------- the prefetcher


def test_prefetched_batches_are_handed_to_the_training_stream(fake_cuda):
    torch.cuda.set_device(1)

    def make(batch, k):
        assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() is pipeline._stream(CUDA1)
        return torch.full((3,), float(10 * batch + k), device=CUDA1) * 2  # written on the pipeline's stream

    training_stream = torch.cuda.current_stream(1)
    for _ in range(2):  # one stream for the process, whatever the number of epochs
        got = []
        for x in pipeline.prefetch(range(4), make, CUDA1, ahead=2):
            got.append((x + 0).tolist())  # the training stream reads it: it must have waited for its event
            assert fake_cuda.blocks[x.untyped_storage().data_ptr()].recorded == {training_stream}
        assert got == [[2.0 * (11 * k)] * 3 for k in range(4)]
    assert pipeline._STREAMS[CUDA1] is pipeline._stream(CUDA1)
    assert fake_cuda.syncs["input-pipeline"] == 0  # the pipeline never waits for the GPU here


def test_the_prefetcher_without_record_stream_is_caught(fake_cuda, monkeypatch):
    """What record_stream is for: a batch the training stream read, freed after the step, goes back to the pipeline's
    stream, whose next batch could be written into it while the step still reads it."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    steps = []
    with pytest.raises(Race, match="freed without record_stream") as caught:
        for x in pipeline.prefetch(range(4), lambda batch, k: torch.full((3,), k, device=CUDA0) * 2, CUDA0):
            steps.append(x + 0)  # the step reads its batch, the host does not wait for it
            del x
    del caught  # its traceback holds the batches in flight: they are freed now, and found alike
    gc.collect()
    fake_cuda.faults.clear()


def test_batches_drawn_ahead_and_never_taken_are_waited_for_when_the_prefetcher_closes(fake_cuda):
    images = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], device=CUDA0)  # the training stream's: resident
    for x in pipeline.prefetch(range(3), lambda batch, k: images[batch] * 2, CUDA0):
        break  # the step limit: the batches drawn ahead are dropped, unread
    assert x.tolist() == [2.0, 4.0]
    # freed onto the training stream while the pipeline's last reads of them are unordered: a Race; images is
    # rebound, not deleted, so that the lambda's name stays bound (the tensor is freed all the same)
    del x
    images = None
    torch.ones(1, device=CUDA0)


# --------------------------------------------------------------------------------------- views as CUDA graphs


def _resident(seed=3):
    images = torch.randint(0, 256, (20, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return pipeline.ResidentViews(images.to(CUDA0), 32, seed, dtype=torch.bfloat16, memory_format=torch.channels_last)


def test_resident_views_are_two_graphs_replayed_from_this_thread_without_a_host_wait(fake_cuda):
    """The views of a set held on the GPU: captured once, replayed a batch ahead on the pipeline's stream, the same
    views as drawn eagerly (the same draws; on the CPU the same bits), in the step's dtype and layout."""
    views = _resident()
    rows = [torch.randint(0, 20, (4,), generator=torch.Generator().manual_seed(k)) for k in range(5)]
    threads = threading.active_count()
    list(views.replayed(rows[:1], first=0))  # the first epoch captures the graphs (a device-wide wait each)
    before = dict(fake_cuda.syncs)
    got = []
    for x in views.replayed(rows, first=7):
        assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last) and x.device == CUDA0
        got.append(x + 0)  # the step reads it on the training stream
        assert threading.active_count() == threads
    assert fake_cuda.syncs == before  # drawing, copying and replaying: no wait for the GPU
    assert len(views.graphed) == 1 and all(len(g.graphs) == 2 for g in views.graphed.values())
    for k, (x, r) in enumerate(zip(got, rows)):
        assert torch.equal(x.cpu(), views(r, 7 + k).cpu())


def test_a_graphs_output_is_rewritten_only_after_the_step_that_read_it(fake_cuda, monkeypatch):
    """Each graph writes one output, two batches apart: its replay waits (on the GPU) for the steps queued so far,
    the one that read that output included. Without that wait the replay races the step."""
    views, rows = _resident(), [torch.randint(0, 20, (4,)) for _ in range(4)]
    launch = pipeline._GraphedViews.launch
    monkeypatch.setattr(pipeline._GraphedViews, "launch",
                        lambda self, slot, indices, generator, after: launch(self, slot, indices, generator,
                                                                             self.side.record_event()))
    with pytest.raises(Race, match="writes memory that .* reads"):
        for x in views.replayed(rows, first=0):
            x + 0


def test_view_parameters_cross_in_one_copy_from_two_pinned_buffers_in_turn(fake_cuda, monkeypatch):
    """A buffer is written again only once its copy has run: the host never waits while the GPU is within two batches;
    when it lags, it waits for that copy (a sync per batch); without that check it would overwrite a queued copy."""
    params = ViewParams(4, 32, 3, CUDA0)
    sizes, generator = torch.full((4, 2), 32.0, dtype=torch.float64), torch.Generator().manual_seed(0)
    before = fake_cuda.syncs["MainThread"]
    for _ in range(4):
        params.draw(generator, sizes)
        p = params.to_device()
    assert fake_cuda.syncs["MainThread"] == before and p["area"].device == CUDA0
    fake_cuda.lagging = True
    for _ in range(3):
        params.draw(generator, sizes)
        params.to_device()
    assert fake_cuda.syncs["MainThread"] == before + 3
    monkeypatch.setattr(Event, "query", lambda self: True)  # a check that says yes without knowing
    params.to_device()
    with pytest.raises(Race, match="writes page-locked memory"):
        params.draw(generator, sizes)
        params.draw(generator, sizes)


def test_file_views_are_drawn_without_a_host_wait_in_the_steps_dtype_and_layout(fake_cuda, tmp_path):
    fake_cuda.use_decoders("nvImageCodec")
    photo_tree(tmp_path / "data")
    trainer = Trainer(Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=16,
                             proj_hidden=16, proj_dim=8, batch_size=4, epochs=1, warmup_epochs=0, workers=0,
                             log_every=100, device="cuda", augment="device", out=str(tmp_path / "run")), progress=False)
    shapes = []
    trainer.learner.backbone.register_forward_pre_hook(
        lambda module, args: shapes.append((args[0].dtype, args[0].is_contiguous(memory_format=torch.channels_last))))
    trainer.train(3)
    assert fake_cuda.syncs["input-pipeline"] == 0 and fake_cuda.decodes == 3
    assert shapes == [(torch.bfloat16, True)] * 3


# ---------------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("decoder", ["nvImageCodec", "TorchCodec", "torchvision"])
def test_jpegs_decoded_on_the_gpu_are_the_cpus_and_the_host_waits_only_inside_torchcodec(fake_cuda, tmp_path, decoder):
    """Decoded on a stream of their own, whatever the caller has queued on its stream; the caller's stream waits for
    it on the GPU. TorchCodec 0.17 waits for its stream itself (twice a batch); nothing else here does."""
    fake_cuda.use_decoders(decoder)
    spec = load_dataset("imagefolder", photo_tree(tmp_path))
    encoded = EncodedImages(spec.train)
    batch = EncodedBatch([encoded[i] for i in range(len(encoded))])
    side = Stream(0)
    with torch.cuda.stream(side):
        busy = torch.ones(8, device="cuda") * 3  # queued work on the caller's stream, which decoding need not wait for
        before = fake_cuda.syncs["MainThread"]
        images = [encoded.decode(batch, CUDA0) for _ in range(3)][-1]
        assert fake_cuda.syncs["MainThread"] - before == (6 if decoder == "TorchCodec" else 0)
        copies = [image + 0 for image in images]  # the caller's stream reads them: ordered after the decoding
    assert fake_cuda.decodes == 3 and busy.device == CUDA0
    torch.cuda.synchronize()  # before another stream reads what the side stream wrote
    for image, copy, expected in zip(images, copies, encoded.decode(batch, torch.device("cpu"))):
        assert image.device == CUDA0 and torch.equal(image.cpu(), expected) and torch.equal(copy.cpu(), expected)


def test_a_decoder_writing_from_its_own_stream_on_the_callers_stream_is_caught(fake_cuda, tmp_path, monkeypatch):
    """Why JPEGs are decoded on a stream of their own: torchvision's (and TorchCodec's) nvJPEG allocates its images on
    the current stream and writes them from its own, which waits for nothing: with work queued on the current stream,
    a block that work still uses can be handed to the decoder's outputs."""
    from bayesncl_pyro.data import decode

    fake_cuda.use_decoders("torchvision")
    monkeypatch.setattr(decode, "decode_stream", lambda device: torch.cuda.current_stream(device))
    encoded = EncodedImages(load_dataset("imagefolder", photo_tree(tmp_path)).train)
    torch.ones(8, device="cuda") * 3
    with pytest.raises(Race, match="work queued on .* that the host has not waited for"):
        encoded.decode(EncodedBatch([encoded[0]]), CUDA0)


@pytest.mark.parametrize("hand_over", ["record_stream", "hold"])
def test_decoded_images_freed_by_the_caller_are_safe_only_as_handed_over(fake_cuda, tmp_path, monkeypatch, hand_over):
    """The caller frees decoded images after reading them on its stream: PyTorch's memory goes back to the decoding
    stream's pool only after that read (record_stream); nvImageCodec's own memory is held until the GPU has passed the
    copy out of it. Without either, freeing it could hand it to the next decode while the read is still queued."""
    from bayesncl_pyro.data import decode

    fake_cuda.use_decoders("torchvision" if hand_over == "record_stream" else "nvImageCodec")
    encoded = EncodedImages(load_dataset("imagefolder", photo_tree(tmp_path)).train)
    batch = EncodedBatch([encoded[0], encoded[1]])
    sums = [sum(image.float().sum() for image in encoded.decode(batch, CUDA0)) for _ in range(3)]  # read, then freed
    assert not decode._HELD  # the GPU kept up: all released
    fake_cuda.lagging = True  # the GPU lags: nvImageCodec's batches are held, up to HELD_BATCHES, then waited for
    before = fake_cuda.syncs["MainThread"]
    for _ in range(4):
        encoded.decode(batch, CUDA0)
    held = hand_over == "hold"
    assert (len(decode._HELD), fake_cuda.syncs["MainThread"] - before) == ((decode.HELD_BATCHES, 2) if held else (0, 0))
    fake_cuda.lagging = False
    if held:
        monkeypatch.setattr(decode, "_HELD",
                            type("Dropped", (collections.deque,), {"append": lambda self, item: None})())
    else:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    with pytest.raises(Race, match="freed without record_stream"):
        for _ in range(2):
            sum(image.float().sum() for image in encoded.decode(batch, CUDA0))
            torch.ones(1, device=CUDA0)
    fake_cuda.faults.clear()
    assert all(torch.isfinite(total) for total in sums)


@pytest.mark.parametrize("decoder", ["TorchCodec", "torchvision"])
def test_a_corrupt_jpeg_on_the_gpu_waits_for_the_decoder_then_falls_back(fake_cuda, tmp_path, decoder):
    fake_cuda.use_decoders(decoder)
    root = photo_tree(tmp_path)
    bad = truncate(root / "train" / "a" / "3.jpg")
    spec = load_dataset("imagefolder", root)
    index = {path: i for i, (path, _) in enumerate(spec.train.samples)}
    encoded = EncodedImages(spec.train)
    with pytest.raises(UserError, match=str(bad)):
        encoded.decode(EncodedBatch([encoded[0], encoded[index[bad]]]), CUDA0)
    skipping = load_dataset("imagefolder", root, skip_bad=True).train
    encoded = EncodedImages(skipping)
    images = encoded.decode(EncodedBatch([encoded[0], encoded[index[bad]], encoded[1]]), CUDA0)
    assert [image.device for image in images] == [CUDA0] * 3
    assert skipping.bad_files == [str(bad)]


def test_nvjpeg_is_replaced_only_for_bad_files_and_the_user_hears_of_it_once(fake_cuda, tmp_path, monkeypatch, caplog):
    """Any RuntimeError fell back to decoding image by image, then to PIL, silently: an out-of-memory error, nvJPEG's
    own allocation failures (a status code) and a decoder without nvJPEG too."""
    from bayesncl_pyro.data import decode

    root = photo_tree(tmp_path)
    bad = truncate(root / "train" / "a" / "3.jpg")
    spec = load_dataset("imagefolder", root, skip_bad=True)
    encoded = EncodedImages(spec.train)
    batch = EncodedBatch([encoded[0], encoded[[path for path, _ in spec.train.samples].index(bad)], encoded[1]])
    for _ in range(2):
        assert [image.device for image in encoded.decode(batch, CUDA0)] == [CUDA0] * 3
    err = caplog.text
    assert err.count("warning: nvJPEG failed on a batch of 3 JPEGs") == 1 and "the 1 that failed alone too" in err

    calls = []
    good = EncodedBatch([encoded[0], encoded[1]])
    for error, raised, match in (
            (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), torch.OutOfMemoryError,
             "memory"),
            (RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 MiB"),
             RuntimeError, "out of memory"),  # torchvision's wrapping of an out-of-memory error inside its decoder
            (RuntimeError("Error while decoding JPEG images: Failed to decode batch: 5"), torch.OutOfMemoryError,
             r"nvJPEG could not allocate memory on cuda:0 to decode 2 JPEGs \(Error while decoding JPEG images: Failed "
             r"to decode batch: 5: an allocation failure\); lower --batch-size"),  # NVJPEG_STATUS_ALLOCATOR_FAILURE
            # TorchCodec's
            (RuntimeError("nvjpegDecode failed: 5"), torch.OutOfMemoryError, "nvJPEG could not allocate"),
            (RuntimeError("Failed to synchronize CUDA stream: 2"), torch.OutOfMemoryError, "could not allocate"),
            # stable ABI, < 2.13
            (RuntimeError("torch_call_dispatcher(...) API call failed at /torch/csrc/stable/ops.h, line 87"),
             RuntimeError, r"a torch call inside the decoder failed on cuda:0 .*lower --batch-size"),
            (RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support"), UserError,
             r"torchvision 9.9 cannot decode JPEGs on cuda:0: decode_jpegs_cuda: torchvision not compiled with nvJPEG "
             r"support; install nvImageCodec .* or a TorchCodec \(or torchvision\) build made for torch .* or pass "
             r"--augment workers"),
            (RuntimeError("Couldn't load the image extension. If you built torchvision from source, ..."), UserError,
             "torchvision 9.9 cannot decode JPEGs on cuda:0: Couldn't load the image extension")):
        def failing(jpegs, device, error=error):
            calls.append(1)
            raise error

        monkeypatch.setattr(decode, "JPEG_DECODERS", [decode.JpegDecoder("torchvision 9.9", failing, True)])
        monkeypatch.setattr(decode, "_CANNOT", {})
        calls.clear()
        with pytest.raises(raised, match=match):
            encoded.decode(good, CUDA0)
        assert len(calls) == 1  # no image-by-image retry

    # a decoder that cannot decode on this GPU gives way to the next, once, and the user hears of it
    fake_cuda.use_decoders("torchvision")
    monkeypatch.setattr(decode, "_CANNOT", {})
    error = RuntimeError("Failed to initialize nvjpeg with hardware backend: 7")
    calls.clear()
    monkeypatch.setattr(decode, "JPEG_DECODERS", [
        decode.JpegDecoder("TorchCodec 9.9", lambda jpegs, device: calls.append(1) or (_ for _ in ()).throw(error),
                           False),
        *decode.JPEG_DECODERS])
    caplog.set_level(logging.INFO, logger="bayesncl_pyro")  # a note: INFO
    for _ in range(2):
        assert [image.device for image in encoded.decode(good, CUDA0)] == [CUDA0] * 2
    assert len(calls) == 1
    assert caplog.text.count("note: TorchCodec 9.9 cannot decode JPEGs on cuda:0 (Failed to initialize "
                             "nvjpeg with hardware backend: 7); torchvision (fake) decodes them instead") == 1


@pytest.mark.parametrize("decoders", [("nvImageCodec", "TorchCodec"), ("TorchCodec", "torchvision")])
def test_under_cudamallocasync_decoders_writing_torch_memory_from_their_own_stream_are_not_used(fake_cuda, tmp_path,
                                                                                             caplog, decoders):
    """TorchCodec's and torchvision's nvJPEG write PyTorch's memory from a stream of their own, which cudaMallocAsync's
    cross-stream reuse does not order; nvImageCodec writes its own memory in the decoding stream's order."""
    caplog.set_level(logging.INFO, logger="bayesncl_pyro")  # the note is INFO
    fake_cuda.backend = "cudaMallocAsync"
    fake_cuda.use_decoders(*decoders)
    photo_tree(tmp_path / "data")
    cfg = Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=16, proj_hidden=16,
                 proj_dim=8, batch_size=4, epochs=1, warmup_epochs=0, workers=0, log_every=1, device="cuda",
                 augment="auto", out=str(tmp_path / "run"))
    trainer = Trainer(cfg, progress=False)
    assert isinstance(trainer.input.views, pipeline.FileViews)
    trainer.train(2)
    workers_decode = "nvImageCodec" not in decoders
    assert ("cudaMallocAsync" in caplog.text) is workers_decode
    encoded = trainer.input.views.encoded
    assert all((encoded[i][0].ndim == 3) is workers_decode or encoded[i][0].ndim == 3 for i in range(len(encoded)))
    assert (fake_cuda.decodes == 0) is workers_decode


# ------------------------------------------------------------------------------------- the training set on the GPU


def test_the_resident_set_fills_one_tensor_on_the_gpu(fake_cuda, tmp_path):
    for i in range(340):
        write_photo(tmp_path / ("test" if i % 10 < 2 else "train") / f"c{i % 2}" / f"{i}.jpg", size=(16, 16), seed=i)
    spec = load_dataset("imagefolder", tmp_path)
    fake_cuda.largest_host_tensor = 0
    images = resident_images(spec.train, CUDA0)
    assert fake_cuda.largest_host_tensor == 256 * 3 * 16 * 16  # one batch: the set is never assembled on the host
    assert images.shape == (272, 3, 16, 16) and images.device == CUDA0
    assert torch.equal(images.cpu(), resident_images(spec.train, torch.device("cpu")))


def test_images_of_another_size_end_the_resident_decoding_at_their_batch(tmp_path, monkeypatch):
    for i in range(600):
        write_photo(tmp_path / ("test" if i % 100 == 0 else "train") / "c" / f"{i:03}.jpg",
                    size=(8, 9 if i == 2 else 8), seed=i)
    read = []
    getitem = resident_module._PixelTensors.__getitem__
    monkeypatch.setattr(resident_module._PixelTensors, "__getitem__",
                        lambda self, i: read.append(i) or getitem(self, i))
    assert resident_images(load_dataset("imagefolder", tmp_path).train, torch.device("cpu")) is None
    assert len(read) == 1 + 256  # the first image's size, then the first batch


# ------------------------------------------------------------------------------------------- the training step


def test_a_step_waits_for_the_gpu_only_when_the_divergence_checks_are_read(fake_cuda, tmp_path):
    trainer = Trainer(_digits(tmp_path, log_every=4, ckpt_every=100, conflict_every=0), progress=False)
    counts = []
    trainer.learner.backbone.register_forward_pre_hook(lambda *_: counts.append(fake_cuda.syncs["MainThread"]))
    trainer.train(6)
    per_step = [b - a for a, b in zip(counts, counts[1:])]  # syncs of steps 1..5, each counted up to the next forward
    assert per_step == [0, 0, 0, per_step[3], 0] and per_step[3] > 0  # step 4 is a log step: it reads the checks
    assert fake_cuda.syncs["input-pipeline"] == 0


def test_worker_views_reach_the_gpu_from_pinned_memory(fake_cuda, tmp_path):
    trainer = Trainer(_digits(tmp_path, augment="workers", log_every=100), progress=False)
    counts = []
    trainer.learner.backbone.register_forward_pre_hook(lambda *_: counts.append(fake_cuda.syncs["MainThread"]))
    trainer.train(3)
    assert counts[1] == counts[0] and counts[2] == counts[1]  # a pageable non_blocking copy would wait


def _poison_grad_at(trainer: Trainer, step: int):
    calls = []
    trainer.learner.backbone.register_forward_pre_hook(lambda *_: calls.append(1))
    next(trainer.learner.backbone.parameters()).register_hook(lambda g: g * float("nan") if len(calls) == step else g)


def _state(trainer: Trainer) -> list[torch.Tensor]:
    """Parameters, buffers (BatchNorm's running statistics), then the optimizer's state."""
    opt = trainer.optimizer
    states = (v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return [t.detach().cpu().clone() for t in [*trainer.learner.parameters(), *trainer.learner.buffers(), *states]]


@pytest.mark.filterwarnings("ignore:Encountered NaN")
@pytest.mark.parametrize("optimizer", ["sgd", "lars", "adamw"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_nan_skip_undoes_the_bad_step_on_the_device(request, tmp_path, device, optimizer):
    if device == "cuda":
        request.getfixturevalue("fake_cuda")
    trainer = Trainer(_digits(tmp_path, device=device, on_nan="skip", log_every=100, optimizer=optimizer),
                      progress=False)
    _poison_grad_at(trainer, 1)  # the first step: it would create the momentum buffers
    trainer.train(1)
    kept = len(list(trainer.learner.parameters())) + len(list(trainer.learner.buffers()))
    assert all(torch.equal(b, torch.zeros_like(b)) for b in _state(trainer)[kept:])  # the momentum buffers it made
    calls = []  # step 3's input is not finite: so are the running statistics its forward pass updates
    trainer.learner.backbone.register_forward_pre_hook(
        lambda module, args: calls.append(1) or ((args[0] * float("nan"),) if len(calls) == 2 else None))
    trainer.train(2)
    before = _state(trainer)
    trainer.train(3)
    assert trainer.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, _state(trainer), strict=True))


@pytest.mark.filterwarnings("ignore:Encountered NaN")
@pytest.mark.parametrize("first, then", [("cpu", "cuda"), ("cuda", "cpu")])
def test_an_adamw_checkpoint_resumes_on_the_other_device_type(fake_cuda, tmp_path, first, then):
    """torch's load_state_dict restores the saved ``capturable`` and, with it, where AdamW's step counts are: on the CPU
    on a GPU (which the guard's masked step cannot write), or capturable on a CPU (which AdamW refuses)."""
    config = lambda device: _digits(tmp_path, device=device, optimizer="adamw", on_nan="skip", log_every=100)  # noqa: E731
    saved = Trainer(config(first), progress=False)
    saved.train(2)
    saved.save()
    resumed = Trainer(config(then), progress=False)
    assert resumed.step == 2
    on_gpu = then == "cuda"
    for group in resumed.optimizer.param_groups:
        assert group["capturable"] is on_gpu
        for p in group["params"]:
            step = resumed.optimizer.state[p]["step"]
            assert step.device == (p.device if on_gpu else torch.device("cpu")) and step.dtype == torch.float32
    _poison_grad_at(resumed, 2)  # step 4: undone on the device, step counts included
    resumed.train(3)
    before = _state(resumed)
    resumed.train(4)
    assert resumed.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, _state(resumed), strict=True))
    assert all(s["step"].item() == 3 for s in resumed.optimizer.state.values())


@pytest.mark.filterwarnings("ignore:Encountered NaN")
def test_a_bad_step_read_late_is_named_before_a_later_failure_and_never_saved(tmp_path):
    trainer = Trainer(_digits(tmp_path, device="cpu", log_every=5, ckpt_every=100), progress=False)
    _poison_grad_at(trainer, 2)

    def refuses_nan_weights(module, args):  # what a sampler does with NaN probabilities
        if not all(p.isfinite().all() for p in module.parameters()):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    trainer.learner.backbone.register_forward_pre_hook(refuses_nan_weights)
    with pytest.raises(UserError, match=r"diverged at step 2: the gradient of backbone\.\S+ \(from InfoNCE\) is not "
                       "finite; no checkpoint is kept"):
        trainer.train(5)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_the_guard_names_each_bad_step_and_follows_the_other_ranks(monkeypatch):
    from bayesncl_pyro.train import guard as divergence

    torch.manual_seed(0)
    net = torch.nn.Module()  # parameter names as the learner's: backbone.*, ...
    net.backbone, net.guide = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    guard = divergence.DivergenceGuard(net, opt, mask=True, rows=3)

    def step(number, extra=0.0, nce=0.0):  # loss: the net's output plus extra; its InfoNCE term: nce
        guard.begin()
        loss = net.guide(net.backbone(torch.ones(1, 3))).sum() + extra
        opt.zero_grad()
        loss.backward()
        with guard.judge(loss, torch.tensor(nce)):
            opt.step()
        guard.keep(number)

    step(1)
    step(2, extra=float("inf"))  # the KL term is loss - InfoNCE
    step(3, nce=float("inf"))
    with pytest.raises(RuntimeError, match="holds 3 unread steps"):
        step(4)
    assert guard.bad_steps() == [(2, "the KL term is inf"), (3, "the InfoNCE term is inf")]
    assert guard.bad_steps() == []  # nothing new: no copy from the device
    step(5, nce=float("nan"))
    assert guard.bad_steps() == [(5, "the InfoNCE term is nan")]
    hook = net.backbone.weight.register_hook(lambda g: g * float("nan"))
    step(6)
    assert guard.bad_steps() == [(6, "the gradient of backbone.weight (from InfoNCE) is not finite")]
    hook.remove()
    net.backbone.weight.requires_grad_(False)  # a parameter without a gradient in a step: its norm counts as 0
    step(7)
    net.backbone.weight.requires_grad_(True)
    assert guard.bad_steps() == []

    # under DDP the verdict is the maximum over the ranks: another rank's bad step is this rank's too, and is undone
    monkeypatch.setattr(divergence.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(divergence.dist, "all_reduce", lambda flag, op: flag.fill_(1.0))
    before = [p.detach().clone() for p in net.parameters()]
    step(8)
    assert guard.bad_steps() == [(8, "a loss or gradient on another process is not finite")]
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))


# ------------------------------------------------------------------------------------ the step as a CUDA graph


def test_the_stand_in_replays_a_capture_as_a_graph_does(fake_cuda):
    """A capture runs nothing and refuses a host sync; a replay reruns its kernels on the same memory, with what
    Python computed during the capture as constants."""
    w, x = torch.zeros(3, device="cuda:0"), torch.ones(3, device="cuda:0")
    lr = torch.tensor(0.5, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    scale = 2.0
    with torch.cuda.graph(graph):
        y = x * scale  # a float: part of the graph
        w.add_(y * lr)  # a tensor: read at each replay
    assert torch.equal(w.cpu(), torch.zeros(3))  # captured, not run
    scale = 3.0
    graph.replay()
    lr.fill_(1.0)
    graph.replay()
    assert torch.equal(w.cpu(), torch.full((3,), 3.0)) and torch.equal(y.cpu(), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            (x.sum() > 0).item()


def _op_log(fn, *args) -> tuple:
    """``fn(*args)``, and the aten ops it issued, each with its non-tensor arguments and its tensors' shapes and
    dtypes."""
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = tree_flatten((args, kwargs or {}))[0]
            ops.append((str(func), *((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                                     a if isinstance(a, (int, float, str, type(None), torch.dtype, torch.device))
                                     else type(a).__name__ for a in flat)))
            return func(*args, **(kwargs or {}))

    with Log():
        return fn(*args), ops


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_consecutive_steps_issue_the_same_ops_when_the_learning_rate_is_on_the_device(fake_cuda, tmp_path, cuda_graphs):
    """What a CUDA graph captures of a step (``Trainer._eager_step``: forward, backward, the guard's verdict, LARS's
    step) issues the same ops with the same arguments at every step once warm, when the learning rates are tensors
    (``--cuda-graphs``); with the schedule's floats, each step's differ, and a graph would replay the first's."""
    trainer = Trainer(_digits(tmp_path, optimizer="lars", cuda_graphs=cuda_graphs, on_nan="skip"), progress=False)
    x = next(iter(trainer.input.batches(0, 8)))
    logs = []

    def logged(x):
        out, ops = _op_log(trainer._eager_step, x)
        logs.append(ops)
        return out

    trainer._step = logged  # the eager step, whether --cuda-graphs would capture it or not
    with pyro.validation_enabled(False):  # as Trainer.train runs its steps
        for _ in range(5):
            trainer.train_step(x)
    assert len(logs[3]) > 100 and (logs[3] == logs[4]) == cuda_graphs


@pytest.mark.parametrize("on_nan, gate", [("stop", "ste"), ("skip", "st-sampled")])
def test_a_cuda_graph_trains_as_its_eager_steps_and_waits_for_the_gpu_only_at_checks(fake_cuda, tmp_path, on_nan, gate,
                                                                                    monkeypatch):
    """--cuda-graphs: 3 eager steps, a capture, replays: the same log records (every monitored figure, read from the
    graph's outputs after each replay) and weights, bit for bit, as the same steps run eagerly, gates drawn at random
    included (st-sampled), and the same host syncs (the checks' reads) but the one before the capture."""
    steps = _step_graphs(monkeypatch)
    runs = {}
    for graphs in (True, False):
        trainer = Trainer(_digits(tmp_path, name=f"graphs{graphs}", optimizer="lars", cuda_graphs=True, log_every=4,
                                  conflict_every=0, on_nan=on_nan, gate=gate), progress=False)
        if not graphs:
            trainer._step = trainer._eager_step
        before = fake_cuda.syncs["MainThread"]
        trainer.train(6)
        runs[graphs] = (fake_cuda.syncs["MainThread"] - before,
                        [{k: v for k, v in r.items() if k != "images_per_s"} for r in read_log(trainer.out)],
                        [p.detach().cpu() for p in trainer.learner.parameters()])
    assert steps[0].graph.replays == 3 and steps[1].graph is None  # the second trainer's steps were eager
    (syncs, records, weights), (eager_syncs, eager_records, eager_weights) = runs[True], runs[False]
    assert syncs == eager_syncs + 1 and records == eager_records and [r["step"] for r in records] == [4, 6]
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights, strict=True))


def test_cuda_graphs_are_refused_where_they_cannot_run(fake_cuda, tmp_path):
    with pytest.raises(UserError, match="--cuda-graphs captures the training step on a CUDA GPU"):
        Trainer(_digits(tmp_path, device="cpu", optimizer="lars", cuda_graphs=True), progress=False)
    with pytest.raises(UserError, match="--optimizer lars or adamw"):
        Trainer(_digits(tmp_path, name="sgd", cuda_graphs=True), progress=False)


def _step_graphs(monkeypatch) -> list[StepGraph]:
    """Every StepGraph made from now on (the resident set's views are CUDA graphs too, replayed every batch)."""
    made, init = [], StepGraph.__init__
    monkeypatch.setattr(StepGraph, "__init__", lambda self, step: (init(self, step), made.append(self))[0])
    return made


def test_bench_steps_trainer_figure_replays_the_captured_step_and_reads_the_gpu_time_from_events(fake_cuda, capsys,
                                                                                                monkeypatch):
    """bench_step.py's "trainer step, no pipeline" on CUDA with --cuda-graphs: 3 eager steps and the capture first,
    then each timed batch one replay, the GPU's time read between two events on the training stream."""
    bench = runpy.run_path(str(Path(__file__).parents[2] / "experiments" / "bench_step.py"))
    args = bench["parser"]().parse_args(["--device", "cuda:0", "--optimizer", "lars", "--cuda-graphs", "--warmup", "0",
                                         "--trainer-batches", "3"])
    cfg = resolve(Config(dataset="digits", batch_size=32, proj_hidden=16, proj_dim=8, device="cuda:0",
                         optimizer="lars"))
    steps = _step_graphs(monkeypatch)
    with pyro.validation_enabled(False):
        bench["trainer_steps"](cfg, args, 1, torch.device("cuda:0"))
    assert [step.graph.replays for step in steps] == [1 + 3]
    assert "trainer step, no pipeline (BayesNCL, cuda_graphs=True, 3 batches)" in capsys.readouterr().out

