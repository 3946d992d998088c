"""DDP on CPU: gloo, 2 processes. One DDP step equals one single-process step on the global batch, the
sampler shards the single-process batches, a 2-process run resumes exactly from its checkpoint, and the ranks
checkpoint by rank 0's clock. Then run_svi.py under torchrun: two nodes, a killed worker, signals to one rank or
to the launcher, another number of processes on resume, and the SLURM script."""

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyro
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import RUN_SVI, assert_same_params, cli, logged_step
from torch.nn.parallel import DistributedDataParallel

from bayesncl_pyro import distributed
from bayesncl_pyro.config import Config
from bayesncl_pyro.data.pipeline import EpochSampler
from bayesncl_pyro.errors import REQUEUE, UserError
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.train import trainer as training
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer

WORLD, B = 2, 8  # processes; images in the global batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process session (starting processes is the slow part) runs every DDP check; each writes its
    results into the returned folder."""
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return out


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        _ddp_step(rank, out)
        _train_and_resume(rank, out)
        _checkpoints_by_the_clock(rank, out)
        dist.barrier()  # neither rank tears its group down while the other still communicates
    finally:
        dist.destroy_process_group()
    # the results are on disk: leave without the interpreter's teardown, where gloo's threads can abort the process
    # ("terminate called without an active exception": seen once in a full suite on this machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


class _Graphs:
    """A torch.compile backend that runs each graph it is given as it is, and counts them."""

    def __init__(self):
        self.count = 0

    def __call__(self, graph, example_inputs):
        self.count += 1
        return graph.forward


BUCKET_MB = 1  # DDP's gradient buckets (DDPOptimizer starts with one of 1 MB): the 1.6 MB learner in two


def _ddp_step(rank, out):
    distributed.setup(torch.device("cpu"))
    pyro.enable_validation(False)  # the fast ELBO path, as in training
    results = {}
    for compiled in (False, True):
        learner, x = _learner_and_batch()
        # the head gathers every rank's rows by itself; net is kept alive until backward: its hooks average the
        # gradients
        net = DistributedDataParallel(learner, bucket_cap_mb=BUCKET_MB)
        graphs = _Graphs()
        if compiled:  # as the Trainer does with --compile: after the wrap
            learner.backbone.compile(backend=graphs)
        loss, _ = net(_local_rows(x, rank))
        loss.backward()
        results[compiled] = dict(loss=loss.detach(), grads={n: p.grad for n, p in learner.named_parameters()},
                                 graphs=graphs.count)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ddp_step_equals_the_single_process_step_on_the_global_batch(two_processes, compiled):
    """Also with the backbone compiled after the DDP wrap (--compile): dynamo then splits its graph at DDP's gradient
    buckets (DDPOptimizer), so each bucket's all-reduce can start while the rest of the backward runs; a single
    process compiles it in one graph."""
    learner, x = _learner_and_batch()
    graphs = _Graphs()
    if compiled:
        learner.backbone.compile(backend=graphs)
    with pyro.validation_enabled(False):
        loss, _ = learner(x)
    loss.backward()
    ranks = [torch.load(two_processes / f"rank{r}.pt")[compiled] for r in range(WORLD)]
    # each rank's loss is the mean over its rows; their mean is the mean over all rows
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / WORLD, loss.detach())
    assert not torch.allclose(ranks[0]["loss"], ranks[1]["loss"])
    for name, p in learner.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        for r in ranks:  # DDP has averaged the gradients: every rank holds the global one
            torch.testing.assert_close(r["grads"][name], p.grad, msg=name)
    assert graphs.count == int(compiled) and all(r["graphs"] > 1 if compiled else r["graphs"] == 0 for r in ranks)


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


def _checkpoints_by_the_clock(rank, root):
    """--ckpt-minutes 2 where a step takes 40 s on rank 0's clock and rank 1's clock says that every step is due:
    the steps at which each rank saves."""
    trainer = Trainer(Config(out=os.path.join(root, "clock"), ckpt_minutes=2, **{**TINY, "epochs": 2}), progress=False)
    clock, saved = [0.0], []
    trainer.learner.backbone.register_forward_pre_hook(lambda *_: clock.__setitem__(0, clock[0] + (40 if rank == 0
                                                                                                  else 1e9)))
    real_save, real_clock = trainer.save, time.monotonic
    trainer.save = lambda: (saved.append(trainer.step), real_save())
    time.monotonic = lambda: clock[0]
    try:
        trainer.train(9)
    finally:
        time.monotonic = real_clock
    torch.save(saved, os.path.join(root, f"clock{rank}.pt"))


def test_checkpoints_by_the_clock_follow_rank_0s_and_every_rank_saves_at_the_same_steps(two_processes):
    """Rank 0's clock reaches 2 minutes at step 3 and its vote is read one step later: a checkpoint at step 4,
    the next at step 8 (due again at step 7, 2 minutes after the one at step 4), on both ranks."""
    assert [torch.load(two_processes / f"clock{r}.pt") for r in range(WORLD)] == [[4, 8], [4, 8]]


def test_two_process_run_resumes_exactly(two_processes):
    """Relaxed gates draw noise on every rank: resuming restores each rank's own RNG stream."""
    params = torch.load(two_processes / "params.pt")
    for k, v in params["straight"].items():
        torch.testing.assert_close(params["resumed"][k], v, rtol=0, atol=0, msg=k)
    log = (two_processes / "a" / "log.jsonl").read_text().splitlines()
    assert len(log) == 7  # rank 0 alone writes the log, and the TensorBoard events
    assert len(list((two_processes / "a").glob("events.out.tfevents.*"))) == 1


# ------------------------------------------------------------------------------ torchrun: nodes, faults, signals
# Real launches of experiments/run_svi.py under torchrun, 2 CPU processes, gloo on the loopback interface only.
# Every run trains the same 32 steps (relaxed gates: each rank draws gate noise; views drawn per (step, rank));
# one uninterrupted 1-node run is the reference.

RUN = Config(dataset="digits", proj_hidden=32, proj_dim=16, batch_size=32, epochs=2, warmup_epochs=0.5, workers=0,
             log_every=1, ckpt_every=4, max_steps=32, gate="relaxed", device="cpu")
STEPS = RUN.max_steps


def env() -> dict:
    # one thread per process, as in every run compared; TORCH_DISABLE_SHARE_RDZV_TCP_STORE: see distributed.setup
    return dict(os.environ, PYTHONPATH=str(RUN_SVI.parents[1]), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def launch(out: Path, nproc: int = 2, nnodes: int = 1, rdzv: list[str] | None = None, restarts: int = 0,
           log: str = "torchrun") -> subprocess.Popen:
    """``torchrun ... run_svi.py`` (nproc 0: plain ``python run_svi.py``) training ``RUN`` into ``out``, in a
    session of its own; its output goes to ``out.parent/<log>.out`` and ``.err``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    rdzv = rdzv or ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", out.name]
    launcher = [] if nproc == 0 else [
        "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *rdzv,
        "--local-addr", "127.0.0.1", "--max-restarts", str(restarts), "--monitor-interval", "0.1"]
    with open(out.parent / f"{log}.out", "w") as so, open(out.parent / f"{log}.err", "w") as se:
        return subprocess.Popen([sys.executable, *launcher, str(RUN_SVI), *cli(replace(RUN, out=str(out)))],
                                stdout=so, stderr=se, env=env(), start_new_session=True)


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, since: int):
    """Until the log shows ``step`` in the lines after its first ``since``."""
    cfg = replace(RUN, out=str(out))
    deadline = time.monotonic() + 300
    while logged_step(cfg, since) < step:
        assert proc.poll() is None and time.monotonic() < deadline, _err(out)
        time.sleep(0.05)


def _err(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in out.parent.glob("*.err"))


def worker(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the torchrun worker of ``rank``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        if ppid == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    raise AssertionError(f"no worker of rank {rank}")


def state(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)


def finished(proc: subprocess.Popen, out: Path) -> dict:
    assert proc.wait(timeout=600) == 0, _err(out)
    saved = state(out)
    assert saved["step"] == STEPS and saved["finished"]
    return saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The checkpoint and log of an uninterrupted 1-node, 2-process run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    saved = finished(launch(out), out)
    return dict(params=saved["learner"], log=read_log(out))


def test_torchrun_restarts_sharing_the_rendezvous_store_are_refused(monkeypatch):
    """With --max-restarts, torchrun's shared store would hand a restarted group the previous one's addresses."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(UserError, match="export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"):
        distributed.setup(torch.device("cpu"))
    assert not dist.is_initialized()


def test_processes_that_disagree_on_the_rows_they_gather_are_refused_at_start(tmp_path, monkeypatch):
    """NCCL does not check that every rank gathers as many rows: ranks started with another --batch-size (or other
    data, another --max-steps) hung or mixed rows up; one gather of the settings at start-up refuses them."""
    monkeypatch.setattr(distributed, "setup", lambda device: (0, 2, device))
    monkeypatch.setattr(distributed, "all_gather_objects",
                        lambda settings: [settings, {**settings, "batch_size": 64, "training_images": 999}])
    with pytest.raises(UserError, match=r"^the processes disagree on batch_size \(rank 0: 32, rank 1: 64\); "
                       r"training_images \(rank 0: \d+, rank 1: 999\); start every process with the same command and "
                       "the same data$"):
        Trainer(replace(RUN, out=str(tmp_path / "run")), progress=False)
    monkeypatch.setattr(distributed, "all_gather_objects", lambda settings: [settings, dict(settings)])
    monkeypatch.setattr(training, "DistributedDataParallel", lambda module, device_ids: module)  # no process group
    assert Trainer(replace(RUN, out=str(tmp_path / "run")), progress=False).world == 2  # agreeing ranks go on


def test_a_global_batch_that_does_not_split_over_the_processes_is_refused(tmp_path, monkeypatch):
    """E.g. a run of batch 32 resumed on 3 processes."""
    monkeypatch.setattr(distributed, "setup", lambda device: (0, 3, device))
    with pytest.raises(UserError, match="--batch-size 32 \\(the global batch\\) does not split evenly over 3 "
                       "processes; pick a multiple of 3"):
        Trainer(replace(RUN, out=str(tmp_path / "run")), progress=False)


@pytest.mark.slow  # a launch topology, not a fault: the default suite keeps two processes on one launcher
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_on_localhost_train_exactly_as_one(reference, tmp_path, rendezvous):
    """Two torchrun launchers of one process each, as on two machines, meet through a c10d store (the node ranks
    come from the order they join) or a static one (given node ranks), and train the same weights, bit for bit,
    as one launcher of two processes."""
    out, port = tmp_path / "run", free_port()
    rdzv = {"c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"],
            "static": ["--master-addr", "127.0.0.1", "--master-port", str(port)]}[rendezvous]
    nodes = [launch(out, nproc=1, nnodes=2, log=f"node{r}",
                    rdzv=rdzv + (["--node-rank", str(r)] if rendezvous == "static" else [])) for r in (0, 1)]
    for node in nodes:
        finished(node, out)
    assert_same_params(state(out)["learner"], reference["params"])


@pytest.mark.slow  # torchrun's fault sequences run once, in CI's slow tests (34 s each with the reference run)
def test_a_worker_killed_mid_epoch_is_restarted_and_resumes_exactly(reference, tmp_path):
    """torchrun --max-restarts 1: SIGKILL of rank 1 after step 6 (checkpoints every 4 steps); torchrun stops
    rank 0, starts both again, they resume from the last checkpoint and end with the uninterrupted run's
    weights."""
    out = tmp_path / "run"
    proc = launch(out, restarts=1)
    wait_for_step(proc, out, 6, since=0)
    os.kill(worker(proc, 1), signal.SIGKILL)
    finished(proc, out)  # exit 0: the group was restarted (without a restart a killed worker fails the run)
    assert "failed (exitcode: -9) local_rank: 1" in _err(out)
    steps = [rec["step"] for rec in read_log(out)]
    # every step trained (the kill may land just after a checkpoint, so that no step is replayed)
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert_same_params(state(out)["learner"], reference["params"])


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_at_one_step_and_the_rerun_resumes_exactly(reference, tmp_path):
    """The pre-emption warning reaches rank 1 only: both ranks stop at the same step, rank 0 saves there, each
    says so and exits 75 (requeue me); the same command resumes and ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    proc = launch(out)
    wait_for_step(proc, out, 5, since=0)
    os.kill(worker(proc, 1), signal.SIGUSR1)
    assert proc.wait(timeout=600) != 0  # torchrun reports failed workers
    saved = state(out)
    assert 5 <= saved["step"] < STEPS and not saved["finished"]
    err = (tmp_path / "torchrun.err").read_text()
    assert err.count("stopped:") == 2 and err.count(f"stopped: SIGUSR1 received: checkpoint saved at step "
                                                     f"{saved['step']} of {STEPS} in {out}; rerun the same command "
                                                     "to resume\n") == 2
    # each rank exits 75 once the checkpoint is written; torchrun SIGTERMs a rank still shutting down as soon as
    # it sees the other's non-zero exit, which races with that rank's own exit: the rank then exits 75 from
    # its SIGTERM handler, or -15 if the signal lands after the handler is gone
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert str(REQUEUE) in codes and set(codes) <= {str(REQUEUE), str(-signal.SIGTERM)}, codes
    assert_same_params(finished(launch(out, log="rerun"), out)["learner"], reference["params"])


@pytest.mark.slow
def test_resuming_on_2_then_1_then_2_processes_continues_the_run(reference, tmp_path):
    """Ctrl-C in torchrun's terminal (SIGINT to its process group: each worker gets it from the terminal and
    again from torchrun, and takes the two as one) stops the 2-process run; one process resumes it until SIGUSR1
    stops it; two processes finish it. The global batch, data order and schedule continue: every
    step is trained once, at the reference's learning rate; the per-process random streams restart (said in
    one line), so the weights differ, but the loss stays finite."""
    out = tmp_path / "run"
    proc = launch(out, log="two")
    wait_for_step(proc, out, 5, since=0)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=600)
    first = state(out)["step"]
    assert (tmp_path / "two.err").read_text().count(f"stopped: SIGINT received: checkpoint saved at step {first} ") == 2
    proc = launch(out, nproc=0, log="one")
    wait_for_step(proc, out, first + 4, since=len(read_log(out)))
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(timeout=600) == REQUEUE
    assert first + 4 <= state(out)["step"] < STEPS
    finished(launch(out, log="again"), out)
    for log, before, now in (("two", None, 2), ("one", 2, 1), ("again", 1, 2)):
        notes = [line for line in (tmp_path / f"{log}.err").read_text().splitlines() if line.startswith("note:")]
        assert notes == ([] if before is None else [
            f"note: {out / 'checkpoint.pt'} was written by {before} process(es), this run has {now}: the global "
            "batch (32), data order and schedule continue; gate noise and device-drawn views come from per-process "
            "random streams, which restart, so the numbers differ from an uninterrupted run's"])
    log = read_log(out)
    assert [rec["step"] for rec in log] == list(range(1, STEPS + 1))  # each stop saved at its step: no replays
    assert [rec["lr"] for rec in log] == [rec["lr"] for rec in reference["log"]]
    assert all(math.isfinite(rec["loss"]) for rec in log)
    assert any(not torch.equal(v, reference["params"][k]) for k, v in state(out)["learner"].items())


# Stand-ins for SLURM's commands, for experiments/slurm_svi.sh on one machine: srun runs its command in a process
# group of its own (the job step), scancel --signal signals that group (slurmstepd signals every process of a
# step), scontrol resolves the node list to the loopback address and notes a requeue; torchrun is this
# interpreter's, on the loopback address. Each refuses arguments that the script should not pass.
FAKE_SLURM = {
    "srun": """[ "$1" = --kill-on-bad-exit=1 ] || { echo "srun: unexpected $*" >&2; exit 1; }
shift
setsid "$@" &
echo $! > "$FAKE_SLURM/step"
wait $!""",
    "scancel": """[ $# = 2 ] && [ "$1" = --signal=TERM ] && [ "$2" = "$SLURM_JOB_ID" ] ||
  { echo "scancel: unexpected $*" >&2; exit 1; }
kill -TERM -- -"$(cat "$FAKE_SLURM/step")\"""",
    "scontrol": """case "$1 $2" in
"show hostnames") [ "$3" = "$SLURM_JOB_NODELIST" ] && echo 127.0.0.1 ;;
"requeue $SLURM_JOB_ID") echo "$2" >> "$FAKE_SLURM/requeued" ;;
*) echo "scontrol: unexpected $*" >&2; exit 1 ;;
esac""",
    "torchrun": f'exec {sys.executable} -m torch.distributed.run --local-addr 127.0.0.1 --monitor-interval 0.1 "$@"',
}


@pytest.mark.slow
def test_slurm_script_checkpoints_at_the_time_limit_warning_requeues_and_resumes_exactly(reference, tmp_path):
    """SIGUSR1 to the batch script (SLURM's --signal=B:USR1@...): the run saves and stops, the script requeues
    its job; the requeued job resumes and ends with the uninterrupted run's weights."""
    bin_dir, out = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    job = dict(env(), PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM=str(tmp_path), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[01]", SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="2")

    def submit(log: str, **more) -> subprocess.Popen:
        with open(tmp_path / f"{log}.out", "w") as so, open(tmp_path / f"{log}.err", "w") as se:
            return subprocess.Popen(["bash", str(RUN_SVI.parent / "slurm_svi.sh"), *cli(replace(RUN, out=str(out)))],
                                    cwd=RUN_SVI.parents[1], stdout=so, stderr=se, start_new_session=True,
                                    env=dict(job, RDZV_PORT=str(free_port()), **more))

    first = submit("first")
    wait_for_step(first, out, 6, since=0)
    os.kill(first.pid, signal.SIGUSR1)
    assert first.wait(timeout=600) != 0
    saved = state(out)
    assert 6 <= saved["step"] < STEPS and not saved["finished"]
    assert (tmp_path / "requeued").read_text() == "4242\n"
    assert "requeueing job 4242: it resumes from its checkpoint" in (tmp_path / "first.out").read_text()
    assert (tmp_path / "first.err").read_text().count(f"checkpoint saved at step {saved['step']} of {STEPS}") == 2
    again = submit("again", SLURM_RESTART_COUNT="1")
    assert_same_params(finished(again, out)["learner"], reference["params"])
    assert (tmp_path / "requeued").read_text() == "4242\n"  # done: not requeued again
