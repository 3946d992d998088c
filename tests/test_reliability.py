"""Faults and bad input during training: kills, signals, divergence, bad images, unwritable folders,
foreign checkpoints. docs/RELIABILITY.md maps every case to its test here."""

import errno
import io
import json
import logging
import os
import pickle
import random
import runpy
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import RUN_SVI, assert_same_params, cli, fast, log_lines, logged_step, make_tree, write_image

import bayesncl_pyro.rundir as rundir
import bayesncl_pyro.train.trainer as training
from bayesncl_pyro.cli import compare as compare_cli
from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import ImageFiles
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import REQUEUE, Stopped, UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.rundir import load_checkpoint
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer


def reference(path: Path, steps: int) -> dict:
    """The parameters of an uninterrupted run after ``steps`` steps."""
    trainer = Trainer(fast(path), progress=False)
    trainer.train(steps)
    return trainer.learner.state_dict()


def start(cfg: Config) -> subprocess.Popen:
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the thread count of the in-process reference runs (conftest), so that sums add up alike
    env = dict(os.environ, PYTHONPATH=str(RUN_SVI.parents[1]), OMP_NUM_THREADS=str(torch.get_num_threads()))
    with open(out.parent / "stdout", "a") as so, open(out.parent / "stderr", "w") as se:
        # a session of its own, so that a signal to its process group plays a terminal's Ctrl-C
        return subprocess.Popen([sys.executable, str(RUN_SVI), *cli(cfg)], stdout=so, stderr=se, env=env,
                                start_new_session=True)


def signal_after(cfg: Config, step: int, signum: int, to_group: bool = False) -> int:
    """Start run_svi, send ``signum`` once it has logged ``step`` itself, and return its exit status. Only this
    run's lines count: an earlier, killed run may have logged that step already (it runs on between the log line
    and the kill), and a signal then would land while the interpreter starts."""
    since = len(log_lines(cfg))
    proc = start(cfg)
    deadline = time.monotonic() + 300
    while logged_step(cfg, since) < step:
        assert proc.poll() is None, (Path(cfg.out).parent / "stderr").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (os.killpg if to_group else os.kill)(proc.pid, signum)
    return proc.wait(timeout=300)


def finish(cfg: Config) -> dict:
    proc = start(cfg)
    assert proc.wait(timeout=600) == 0, (Path(cfg.out).parent / "stderr").read_text()
    return load_checkpoint(Path(cfg.out) / "checkpoint.pt")


# ------------------------------------------------------------------------------------ kills and signals


@pytest.mark.slow
def test_sigkills_and_ctrl_c_then_rerun_match_an_uninterrupted_run(tmp_path):
    """SIGKILL at two points, then Ctrl-C (SIGINT to the whole process group, as from a terminal) with
    2 loader workers, then the same command to the end: the parameters of a 0-worker uninterrupted run.
    Checkpoints every 2 steps, so a kill loses steps, which the resume replays. A run goes on for some
    steps between its log line and the signal (each step takes milliseconds), hence 40 steps for a
    Ctrl-C at step 8."""
    cfg = fast(tmp_path / "stopped" / "run", max_steps=40)
    for step, workers in ((2, 0), (5, 2)):
        assert signal_after(replace(cfg, workers=workers), step, signal.SIGKILL) == -signal.SIGKILL
    cfg = replace(cfg, workers=2)
    assert signal_after(cfg, 8, signal.SIGINT, to_group=True) == 130
    stderr = (tmp_path / "stopped" / "stderr").read_text()
    saved = load_checkpoint(tmp_path / "stopped" / "run" / "checkpoint.pt")
    assert stderr == (f"stopped: SIGINT received: checkpoint saved at step {saved['step']} of 40 in {cfg.out}; "
                      "rerun the same command to resume\n")
    assert 8 <= saved["step"] < 40 and not saved["finished"]
    state = finish(cfg)
    assert state["step"] == 40 and state["finished"]
    assert_same_params(state["learner"], reference(tmp_path / "ref", 40))


def test_crash_inside_a_checkpoint_write_keeps_the_previous_one_and_resumes_exactly(tmp_path):
    """What a crash during ``atomic_save`` leaves on disk: the previous checkpoint (and, after a SIGKILL, a partial
    .tmp, which the next run removes)."""
    first = Trainer(fast(tmp_path / "run"), progress=False)
    first.train(4)  # checkpoints at steps 2 and 4
    good = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def dies_halfway(obj, f):  # the bytes a killed writer would have got out, then death
        real_save(obj, f)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "save", dies_halfway)
        with pytest.raises(KeyboardInterrupt):
            first.train(8)  # dies writing the checkpoint of step 6
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == good
    assert not list((tmp_path / "run").glob("*.tmp"))  # an interrupted write removes its temporary file
    killed = tmp_path / "run" / "checkpoint.pt.99999.tmp"  # what a SIGKILL'd writer leaves: half a file
    killed.write_bytes(good[:len(good) // 2])
    del first  # its process ends: the run folder's lock goes with it
    resumed = Trainer(fast(tmp_path / "run"), progress=False)
    assert resumed.step == 4 and not killed.exists()
    resumed.train(8)
    assert_same_params(resumed.learner.state_dict(), reference(tmp_path / "ref", 8))


def test_ctrl_c_inside_a_checkpoint_write_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    """torch.save's zip writer, interrupted, fails on closing with a RuntimeError that would hide the Ctrl-C
    (a traceback instead of run_svi's "stopped: interrupted")."""
    class Interrupted(io.FileIO):
        def write(self, data):
            if self.tell() > 0:  # after the zip writer's first record
                raise KeyboardInterrupt
            return super().write(data)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Interrupted(fd, "w"))  # the temporary file atomic_save opens
    with pytest.raises(KeyboardInterrupt):
        rundir.atomic_save({"w": torch.zeros(1000)}, tmp_path / "checkpoint.pt")
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.slow
def test_sigkill_at_random_times_always_resumes_to_the_same_params(tmp_path):
    cfg = fast(tmp_path / "killed" / "run", max_steps=30, ckpt_every=1)  # many kills land in a write
    rng = random.Random(0)
    for _ in range(6):
        proc = start(cfg)
        time.sleep(rng.uniform(4, 12))  # past the imports, somewhere in training
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    state = finish(cfg)
    assert_same_params(state["learner"], reference(tmp_path / "ref", 30))


def signals_during_step(trainer: Trainer, step: int, *signums: int):
    """Raise ``signums`` in the main thread from inside the forward pass of training step ``step``, each handled
    before the next is sent (``os.kill`` of the process may land in one of torch's threads, where two signals sent
    back to back can reach Python's handler as one, as two Ctrl-C a human presses never do)."""
    calls = []

    def send(module, args):
        calls.append(1)
        if len(calls) == step:
            for signum in signums:
                signal.raise_signal(signum)

    trainer.learner.backbone.register_forward_pre_hook(send)


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    signals_during_step(trainer, 3, signal.SIGTERM)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="SIGTERM received: checkpoint saved at step 3 of 10") as stop:
        trainer.train(10)
    assert stop.value.exit_code == REQUEUE == 75
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is before  # handlers are put back


def test_ckpt_minutes_checkpoints_by_the_clock(tmp_path, monkeypatch):
    """--ckpt-minutes 2 where every step takes 40 s: a checkpoint every third step (a single process reads its
    own clock at once), none from --ckpt-every."""
    trainer = Trainer(fast(tmp_path / "run", ckpt_every=100, ckpt_minutes=2), progress=False)
    clock, saved = [0.0], []
    trainer.learner.backbone.register_forward_pre_hook(lambda *_: clock.__setitem__(0, clock[0] + 40))
    monkeypatch.setattr(training.time, "monotonic", lambda: clock[0])
    real_save = training.atomic_save
    monkeypatch.setattr(training, "atomic_save",
                        lambda state, path: (saved.append(state["step"]), real_save(state, path)))
    trainer.train(10)
    assert saved == [3, 6, 9]


def test_a_second_ctrl_c_interrupts_at_once(tmp_path):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    signals_during_step(trainer, 3, signal.SIGINT, signal.SIGINT)
    # Python's own Ctrl-C handler, as at a terminal: a job started in the background (`nohup`, `&` in a script)
    # inherits SIGINT ignored, and there a second Ctrl-C is ignored as the first would have been
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train(10)
    finally:
        signal.signal(signal.SIGINT, outside)
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 2  # the last periodic one


def test_ctrl_c_during_the_final_checkpoint_is_a_stop_and_a_rerun_evaluates(tmp_path, monkeypatch):
    """A Ctrl-C that arrives once the last step is done, while the finished run is written, lets the write
    end and stops before evaluating; rerunning evaluates the trained run."""
    cfg = fast(tmp_path / "run", max_steps=4)
    real_save = training.atomic_save

    def interrupted(state, path):
        if state["finished"]:
            os.kill(os.getpid(), signal.SIGINT)
        real_save(state, path)

    monkeypatch.setattr(training, "atomic_save", interrupted)
    with pytest.raises(Stopped, match="SIGINT received: training finished, checkpoint saved at step 4 in .*; "
                       "rerun the same command to evaluate it") as stop:
        Trainer(cfg, progress=False).fit()
    assert stop.value.exit_code == 130
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["finished"]
    assert not (tmp_path / "run" / "eval.json").exists()
    monkeypatch.undo()
    rerun = Trainer(cfg, progress=False)
    assert rerun.step == 4 and "linear_probe_top1" in rerun.fit().evaluate()


@pytest.mark.parametrize("raised, code, printed", [
    (UserError("bad value"), 2, "error: bad value"),
    (Stopped("SIGINT received", signal.SIGINT), 130, "stopped: SIGINT received"),
    (Stopped("SIGTERM received", signal.SIGTERM), 75, "stopped: SIGTERM received"),
    (Stopped("SIGUSR1 received", signal.SIGUSR1), 75, "stopped: SIGUSR1 received"),
    (KeyboardInterrupt(), 130, "stopped: interrupted; rerun the same command to resume"),
])
def test_run_svi_exit_codes(monkeypatch, capsys, raised, code, printed):
    class Failing:
        def __init__(self, cfg, overwrite):
            raise raised

    monkeypatch.setattr(training, "Trainer", Failing)
    assert run_svi.main(["--out", "unused"]) == code
    assert capsys.readouterr().err == printed + "\n"


def test_a_stopped_comparison_says_so_in_one_line(monkeypatch, capsys):
    """compare.py trains run after run: a scheduler's signal stops the one in training (checkpoint saved) and the
    command exits as run_svi does, so a batch script requeues it, and rerunning it resumes."""
    def stopped(args):
        raise Stopped("SIGTERM received: checkpoint saved at step 3 of 10 in runs/x; rerun the same command to "
                      "resume", signal.SIGTERM)

    monkeypatch.setattr(compare_cli, "compare", stopped)
    assert compare_cli.main(["--dataset", "digits"]) == REQUEUE
    assert capsys.readouterr().err == ("stopped: SIGTERM received: checkpoint saved at step 3 of 10 in runs/x; rerun "
                                       "the same command to resume\n")


def test_ctrl_c_while_run_svi_loads_its_libraries_is_one_line(monkeypatch, capsys):
    class CtrlC:  # the import system meets the KeyboardInterrupt as run_svi imports bayesncl_pyro.config
        def find_spec(self, name, path=None, target=None):
            if name == "bayesncl_pyro.config":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "bayesncl_pyro.config")
    monkeypatch.delitem(sys.modules, "bayesncl_pyro.cli.run_svi")  # the script imports it afresh
    monkeypatch.setattr(sys, "meta_path", [CtrlC(), *sys.meta_path])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(RUN_SVI), run_name="__main__")
    assert exit.value.code == 130
    assert capsys.readouterr().err == "stopped: interrupted; rerun the same command to resume\n"


def test_run_svi_flags():
    parser = run_svi.parser
    args = vars(parser().parse_args(["--skip-bad-images", "--on-nan", "skip", "--overwrite", "--ckpt-minutes", "30"]))
    assert args["skip_bad_images"] and args["on_nan"] == "skip" and args["overwrite"] and args["ckpt_minutes"] == 30
    with pytest.raises(UserError, match="--ckpt-minutes must be positive, got 0"):
        resolve(Config(ckpt_minutes=0))
    with pytest.raises(SystemExit):
        parser().parse_args(["--on-nan", "ignore"])
    with pytest.raises(UserError, match="unknown --on-nan 'ignore'; choose one of: stop, skip"):
        resolve(Config(on_nan="ignore"))


# ------------------------------------------------------------------------------------------- divergence


def _nan_at_step(trainer: Trainer, step: int, where: str):
    """Make step ``step`` non-finite in the InfoNCE term, or in one encoder gradient only."""
    calls = []
    learner = trainer.learner

    def count(module, args):
        calls.append(1)

    def poison(value):
        return value * float("nan") if len(calls) == step else value

    learner.backbone.register_forward_pre_hook(count)
    if where == "InfoNCE":
        learner.head.projector.register_forward_hook(lambda m, a, out: poison(out))
    else:
        next(learner.backbone.parameters()).register_hook(poison)


@pytest.mark.filterwarnings("ignore:Encountered NaN")  # Pyro's, for the NaN made on purpose
@pytest.mark.parametrize("where, message", [
    ("InfoNCE", "the InfoNCE term is nan"),
    ("grad", r"the gradient of backbone\.\S+ \(from InfoNCE\) is not finite"),
])
def test_divergence_stops_naming_step_and_term_and_keeps_the_last_good_checkpoint(tmp_path, where, message):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    _nan_at_step(trainer, 5, where)
    with pytest.raises(UserError, match=f"diverged at step 5: {message}; the last good checkpoint \\(step 4\\)"):
        trainer.train(10)
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert saved["step"] == 4
    assert all(v.isfinite().all() for v in saved["learner"].values() if v.is_floating_point())


def test_divergence_in_the_kl_term_is_named(tmp_path, monkeypatch):
    import bayesncl_pyro.infer.kl  # where the ELBO takes the gates' KL

    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    monkeypatch.setattr(bayesncl_pyro.infer.kl, "bernoulli_kl",
                        lambda q, p, clamp: torch.full_like(q, float("inf")))
    with pytest.raises(UserError, match="diverged at step 1: the KL term is (inf|nan); no checkpoint is kept"):
        trainer.train(3)


@pytest.mark.filterwarnings("ignore:Encountered NaN")  # Pyro's, for the NaN made on purpose
def test_on_nan_skip_skips_the_step_and_reports_it(tmp_path, caplog):
    trainer = Trainer(fast(tmp_path / "run", on_nan="skip"), progress=False)
    _nan_at_step(trainer, 2, "InfoNCE")
    trainer.train(4)
    assert trainer.step == 4 and trainer.skipped_steps == 1
    assert all(p.isfinite().all() for p in trainer.learner.parameters())
    assert "warning: step 2: the InfoNCE term is nan; step skipped" in caplog.text
    trainer.save()
    assert Trainer(fast(tmp_path / "run", on_nan="skip"), progress=False).skipped_steps == 1


# ------------------------------------------------------------------------------------------- bad images


def _tree_with_a_bad_image(root: Path) -> Path:
    make_tree(root, {"train": ["a", "b"], "val": ["a", "b"]})
    for c in "ab":
        for i in range(1, 6):
            write_image(root / "train" / c / f"{i}.png", "RGBA" if i == 1 else "L" if i == 2 else "RGB")
    bad = root / "train" / "b" / "3.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    return bad


def _image_run(tmp_path: Path, **kw) -> Config:
    return Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=8,
                  proj_hidden=16, proj_dim=8, batch_size=4, epochs=1, warmup_epochs=0, workers=2,
                  out=str(tmp_path / "run"), **kw)


def test_bad_image_in_a_loader_worker_is_one_line_naming_the_file(tmp_path):
    bad = _tree_with_a_bad_image(tmp_path / "data")
    with pytest.raises(UserError) as err:
        Trainer(_image_run(tmp_path), progress=False).fit()
    assert str(bad) in str(err.value) and "--skip-bad-images" in str(err.value)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)


def test_no_readable_image_at_all_is_named(tmp_path):
    bad = [write_image(tmp_path / f"{i}.png") for i in range(2)]
    for path in bad:
        path.write_bytes(b"junk")
    with pytest.raises(UserError, match=f"none of the 2 images could be read \\(first bad file: {bad[0]}\\)"):
        ImageFiles([(p, 0) for p in bad], skip_bad=True)[0]


def test_skip_bad_images_trains_and_counts_them_across_workers(tmp_path, caplog):
    bad = _tree_with_a_bad_image(tmp_path / "data")
    Trainer(_image_run(tmp_path, skip_bad_images=True), progress=False).fit().evaluate()
    assert "warning: 1 unreadable images were skipped" in caplog.text
    assert set((tmp_path / "run" / "bad_images.txt").read_text().splitlines()) == {str(bad)}


# ------------------------------------------------------------------------------------- the run folder


def test_overwrite_moves_the_previous_run_aside_and_deletes_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="bayesncl_pyro")  # the move is said at INFO
    old = Trainer(fast(tmp_path / "run"), progress=False)
    old.save()
    Trainer(fast(tmp_path / "run", temperature=0.5), progress=False, overwrite=True)
    aside = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and "moved the previous run's files" in caplog.text
    assert {p.name for p in aside[0].iterdir()} == {"config.json", "checkpoint.pt"}
    assert json.loads((aside[0] / "config.json").read_text())["temperature"] == 0.2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["temperature"] == 0.5
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("text, match", [
    ("{ not json", r"config.json is not readable JSON \(Expecting property name .*\); pass --overwrite to move the "
                   "folder's files aside"),
    ('{"dataset": "digits", "mixup": 1}', r"unknown keys \['mixup'\]: it was written by another version"),
])
def test_unreadable_config_json_is_refused(tmp_path, text, match):
    Trainer(fast(tmp_path / "run"), progress=False)  # our run: its marker and config.json
    (tmp_path / "run" / "config.json").write_text(text)
    with pytest.raises(UserError, match=match):
        Trainer(fast(tmp_path / "run"), progress=False)


def test_output_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot create the output folder .*choose another --out"):
        Trainer(fast(tmp_path / "file" / "run"), progress=False)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_read_only_or_full_output_folder(tmp_path, monkeypatch, code):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    trainer.train(2)
    trainer.save()
    good = (tmp_path / "run" / "checkpoint.pt").read_bytes()

    def failing_save(obj, f):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", failing_save)
    fix = "choose another --out, in a folder you can write" if code == errno.EROFS else \
        "free some space or choose another --out"
    with pytest.raises(UserError, match=f"cannot write .*checkpoint.pt: {os.strerror(code)}; {fix} "
                       "\\(any previous checkpoint.pt is unchanged\\)"):
        trainer.train(4)  # checkpoints at step 4
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == good
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_a_read_only_output_folder_is_one_line(tmp_path):
    """On a read-only mount (a bind mount remounted read-only in a mount namespace of its own, which ends with the
    process: root ignores file modes, not a read-only mount): one error line, exit status 2."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to make a read-only mount")
    (tmp_path / "src" / "run").mkdir(parents=True)
    (tmp_path / "ro").mkdir()
    src, ro = tmp_path / "src", tmp_path / "ro"
    mount = f"mount --bind {src} {ro} && mount -o remount,bind,ro {ro}"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"{mount} && ! touch {ro}/x"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot make a read-only mount here (needs root or CAP_SYS_ADMIN): {probe.stderr.decode()[:200]}")
    args = " ".join(cli(fast(ro / "run", max_steps=2)))
    env = dict(os.environ, PYTHONPATH=str(RUN_SVI.parents[1]))
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", f"{mount} && exec {sys.executable} {RUN_SVI} {args}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: cannot lock {ro}/run: {ro}/run/run.lock cannot be opened for writing (Read-only "
                           "file system), and without its lock a second run could train in the folder at the same "
                           "time; choose another --out, in a folder you can write\n")
    assert not list((src / "run").iterdir())


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux's /proc/self/fd")
def test_full_disk_while_logging(tmp_path, monkeypatch):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    real = os.write

    def full(fd, data):  # every write into the log: ENOSPC (a link to /dev/full is refused now: rundir's rule)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("log.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(UserError, match="cannot write .*log.jsonl: No space left on device; free some space"):
        trainer.train(2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu():
    with pytest.raises(UserError, match="--device cuda was asked for but PyTorch sees no CUDA GPU"):
        pick_device("cuda")


# ---------------------------------------------------------------------------------- foreign checkpoints


def _copy_checkpoint_into(tmp_path: Path, **kw) -> Path:
    """A checkpoint made by a run with ``kw``, copied into a fresh folder of the default FAST run."""
    other = Trainer(fast(tmp_path / "other", **kw), progress=False)
    other.save()
    Trainer(fast(tmp_path / "run"), progress=False)
    (tmp_path / "other" / "checkpoint.pt").rename(tmp_path / "run" / "checkpoint.pt")
    return tmp_path / "run" / "checkpoint.pt"


@pytest.mark.parametrize("kw, match", [
    (dict(prior="learned"), "prior: 'learned' -> 'bernoulli'"),
    (dict(proj_dim=8), "proj_dim: 8 -> 16"),
    (dict(method="ncl"), "method: 'ncl' -> 'bayesncl'"),
])
def test_checkpoint_of_another_configuration_is_explained(tmp_path, kw, match):
    _copy_checkpoint_into(tmp_path, **kw)
    with pytest.raises(UserError, match=f"written by a run with another configuration \\({match}"):
        Trainer(fast(tmp_path / "run"), progress=False)


def test_checkpoint_of_another_version_is_explained(tmp_path):
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    state = trainer.state_dict()
    weights = state["learner"]
    weights["backbone.renamed"] = weights.pop(next(iter(weights)))
    key = next(k for k in weights if k.startswith("head.guide.") and weights[k].dim() == 2)
    weights[key] = weights[key][:, :3]
    state["version"] = "0.0.1"
    torch.save(state, tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(UserError, match=f"\\(bayesncl-pyro 0.0.1\\) does not fit the model of bayesncl-pyro "
                       f".*{key} is .* there but .* here.*missing.*backbone.renamed unexpected; load it with"):
        load_learner(tmp_path / "run")
    with pytest.raises(UserError, match="does not fit the model"):
        Trainer(fast(tmp_path / "run"), progress=False)


@pytest.mark.parametrize("bad, match", [("huge", "of shape"), ("broadcast", "broadcast view"), ("shape", "of shape"),
                                        ("rng", "random-number")])
def test_a_checkpoint_whose_saved_state_would_be_materialised_or_misfit_is_refused(tmp_path, bad, match):
    """A small checkpoint holding a stride-0 momentum buffer of 2^31 elements asked for 8 GiB on resume."""
    trainer = Trainer(fast(tmp_path / "run", max_steps=1), progress=False)
    trainer.fit()
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    buffers = next(iter(state["optimizer"]["state"].values()))
    name = next(k for k, v in buffers.items() if torch.is_tensor(v) and v.numel() > 1)
    if bad == "huge":
        buffers[name] = torch.zeros(1, dtype=torch.float64).expand(2**31)
    elif bad == "broadcast":
        buffers[name] = torch.zeros(1).expand(buffers[name].shape)
    elif bad == "shape":
        buffers[name] = buffers[name].reshape(-1)[:3].clone()
    else:
        state["rng"][0]["torch"] = torch.zeros(7, dtype=torch.uint8)
    state["finished"] = False
    torch.save(state, tmp_path / "run" / "checkpoint.pt")
    assert (tmp_path / "run" / "checkpoint.pt").stat().st_size < 2**24  # the file is small; loading it was not
    with pytest.raises(UserError, match=match):
        Trainer(fast(tmp_path / "run", max_steps=2), progress=False)


def test_checkpoint_of_another_training_set_is_refused(tmp_path):
    path = _copy_checkpoint_into(tmp_path)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "num_train": 1000}, path)
    with pytest.raises(UserError, match="trained on 1000 images but the training set now holds 1437"):
        Trainer(fast(tmp_path / "run"), progress=False)


class _Exploit:
    def __reduce__(self):
        return os.system, ("touch pwned",)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("content", ["not a checkpoint", "pickle", "exploit"])
def test_unusable_checkpoint_files_are_refused_without_running_code(tmp_path, monkeypatch, content):
    Trainer(fast(tmp_path / "run"), progress=False)
    path = tmp_path / "run" / "checkpoint.pt"
    if content == "not a checkpoint":
        torch.save({"weights": torch.zeros(2)}, path)
    elif content == "pickle":
        path.write_bytes(b"garbage" * 10)
    else:
        path.write_bytes(pickle.dumps(_Exploit()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="not a bayesncl-pyro checkpoint"):
        Trainer(fast(tmp_path / "run"), progress=False)
    assert not (tmp_path / "pwned").exists()
