"""DDP on CPU: gloo, 2 processes. One DDP step equals one single-process step on the global batch, the
sampler shards the single-process batches, and a 2-process run resumes exactly from its checkpoint."""

import os
import socket

import pyro
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from bayesncl_pyro import distributed
from bayesncl_pyro.config import Config, resolve
from bayesncl_pyro.learner import ContrastiveLearner
from bayesncl_pyro.training import EpochSampler, Trainer

WORLD, B = 2, 8  # processes; images in the global batch


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process session (starting processes is the slow part) runs every DDP check; each writes its
    results into the returned folder."""
    out = tmp_path_factory.mktemp("ddp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=WORLD)
    return out


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        _ddp_step(rank, out)
        _train_and_resume(rank, out)
    finally:
        dist.destroy_process_group()


def _learner_and_batch():
    """A gated learner with a learned prior (so model, guide and encoder all get gradients) and one global
    batch of 2B rows [view 1; view 2]. BatchNorm uses running statistics: on CPU there is no
    SyncBatchNorm, so per-rank batch statistics would differ from the global batch's."""
    torch.manual_seed(0)
    cfg = resolve(Config(dataset="digits", method="bayesncl", prior="learned", gate="ste", proj_hidden=32, proj_dim=16,
                         kl_weight=0.05))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    learner.backbone.eval()
    return learner, torch.randn(2 * B, 1, 8, 8)


def _local_rows(x, rank):
    """Rank r's share of the global batch: its B / W images, both views, as [view 1; view 2]."""
    mine = torch.arange(rank * B // WORLD, (rank + 1) * B // WORLD)
    return torch.cat([x[mine], x[B + mine]])


def _ddp_step(rank, out):
    distributed.setup(torch.device("cpu"))
    pyro.enable_validation(False)  # the fast ELBO path, as in training
    learner, x = _learner_and_batch()
    net = DistributedDataParallel(learner)  # the head gathers every rank's rows by itself  # kept alive until backward: its hooks average the gradients
    loss, _ = net(_local_rows(x, rank))
    loss.backward()
    torch.save(dict(loss=loss.detach(), grads={n: p.grad for n, p in learner.named_parameters()}),
               os.path.join(out, f"rank{rank}.pt"))


def test_ddp_step_equals_the_single_process_step_on_the_global_batch(two_processes):
    learner, x = _learner_and_batch()
    with pyro.validation_enabled(False):
        loss, _ = learner(x)
    loss.backward()
    ranks = [torch.load(two_processes / f"rank{r}.pt") for r in range(WORLD)]
    # each rank's loss is the mean over its rows; their mean is the mean over all rows
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / WORLD, loss.detach())
    assert not torch.allclose(ranks[0]["loss"], ranks[1]["loss"])
    for name, p in learner.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        for r in ranks:  # DDP has averaged the gradients: every rank holds the global one
            torch.testing.assert_close(r["grads"][name], p.grad, msg=name)


def test_sampler_shards_are_slices_of_the_single_process_batches():
    single = list(EpochSampler(50, 8, seed=1))
    shards = [list(EpochSampler(50, 8, seed=1, rank=r, world=2)) for r in range(2)]
    assert len(single) == 48 and all(len(s) == 24 for s in shards)
    for b in range(6):
        assert single[8 * b:8 * b + 8] == shards[0][4 * b:4 * b + 4] + shards[1][4 * b:4 * b + 4]
    resumed = EpochSampler(50, 8, seed=1, rank=1, world=2)
    resumed.set_epoch(0, start_batch=2)
    assert list(resumed) == shards[1][8:]


TINY = dict(dataset="digits", proj_hidden=32, proj_dim=16, batch_size=200, epochs=1, warmup_epochs=0.5,
            workers=0, log_every=1, ckpt_every=100, device="cpu", tensorboard=True)


def _train_and_resume(rank, root):
    straight = Trainer(Config(out=os.path.join(root, "a"), **TINY), progress=False)
    straight.train(straight.total_steps)
    first = Trainer(Config(out=os.path.join(root, "b"), max_steps=4, **TINY), progress=False)  # mid-epoch
    first.train(4)
    first.save()
    resumed = Trainer(Config(out=os.path.join(root, "b"), **TINY), progress=False)
    assert resumed.step == 4
    resumed.train(resumed.total_steps)
    if rank == 0:
        torch.save(dict(straight=straight.learner.state_dict(), resumed=resumed.learner.state_dict()),
                   os.path.join(root, "params.pt"))


def test_two_process_run_resumes_exactly(two_processes):
    """Relaxed gates draw noise on every rank: resuming restores each rank's own RNG stream."""
    params = torch.load(two_processes / "params.pt")
    for k, v in params["straight"].items():
        torch.testing.assert_close(params["resumed"][k], v, rtol=0, atol=0, msg=k)
    log = (two_processes / "a" / "log.jsonl").read_text().splitlines()
    assert len(log) == 7  # rank 0 alone writes the log, and the TensorBoard events
    assert len(list((two_processes / "a").glob("events.out.tfevents.*"))) == 1
