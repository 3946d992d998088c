"""The one rule of every reader and writer of a run folder (bayesncl_pyro/rundir/): a file in it is opened without
following a symbolic link and only if it is a regular file, reads are capped, writes go by a temporary file renamed
into a real folder of the run; the lock is taken or the run refused; a run is known by our marker, never by a
config.json. Each reader and writer meets a link to a file outside, a link to /dev/zero and a FIFO.
docs/RELIABILITY.md maps each to its test."""

import errno
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, fast

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import export as export_script
from bayesncl_pyro.cli import inspect_gates, run_svi
from bayesncl_pyro.cli import report as report_script
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.run import load_run
from bayesncl_pyro.train.plan import record, recorded_run
from bayesncl_pyro.train.trainer import Trainer

KINDS = ["link", "dev-zero", "fifo"]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _plant(path: Path, kind: str, outside: Path) -> str:
    """Put ``kind`` where the run's file ``path`` is: a link to the file ``outside``, a link to /dev/zero or a FIFO;
    returns how the error line that refuses it begins."""
    if os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return (f"error: {path} is a named pipe (FIFO), not a regular file; a run's files are regular files: move it "
                "away")
    target = outside if kind == "link" else Path("/dev/zero")
    path.symlink_to(target)
    return (f"error: {path} is a symbolic link, to {target}; a file of a run folder is never read or written through "
            "one (it may point anywhere): replace the link by the file, or move it away")


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file of the user's outside the run folder, which nothing may read into a report or write over."""
    path = tmp_path / "secret.txt"
    path.write_text("keep\n")
    return path


def _as_script(read, *args) -> int:
    """``read(*args)`` as a script reports it: its UserError one error line, exit status 2."""
    try:
        read(*args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


# reader -> (the file of the run it reads, the reader called on the run folder and the run's Config)
READERS = {
    "report.py": ("eval.json", lambda run, cfg: report_script.main([str(run)])),
    "report.py (log)": ("log.jsonl", lambda run, cfg: report_script.main([str(run)])),
    "inspect_gates.py": ("conflict.jsonl", lambda run, cfg: inspect_gates.main([str(run)])),
    "export.py": ("checkpoint.pt", lambda run, cfg: export_script.main([str(run), "--out", str(run.parent / "b.pt")])),
    "load_run": ("checkpoint.pt", lambda run, cfg: _as_script(load_run, run)),
    "run_svi.py (resume)": ("config.json", lambda run, cfg: run_svi.main([*TINY_RUN, "--conflict-every", "1", "--out",
                                                                          str(run)])),
    "compare.py --record": ("config.json", lambda run, cfg: _as_script(recorded_run, run, cfg)),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_link_a_fifo_and_dev_zero_in_one_line(bayes_run, tmp_path, capsys, outside, reader,
                                                                     kind):
    name, read = READERS[reader]
    run = shutil.copytree(bayes_run, tmp_path / "run")
    cfg = Config.from_dict(json.loads((run / "config.json").read_text()))
    begins = _plant(run / name, kind, outside)
    assert read(run, cfg) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(begins)
    assert outside.read_text() == "keep\n" and not (run / "report").exists() and not (run / "inspect").exists()


def test_a_file_larger_than_its_limit_is_refused_unread(bayes_run, tmp_path, capsys):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    os.truncate(run / "eval.json", rundir.JSON_LIMIT + 1)  # sparse: no disk, but a MemoryError were it read
    assert report_script.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'eval.json'} holds {rundir.JSON_LIMIT + 1:,} bytes, more than the {rundir.JSON_LIMIT:,} that "
        "a file of its kind is read up to; it is not what a run writes: move it away")


def test_a_config_file_that_is_a_device_or_too_large_is_one_line(tmp_path, capsys):
    assert run_svi.main(["--config", "/dev/zero"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "error: /dev/zero is a device, not a regular file; pass a regular file")
    (tmp_path / "real.json").write_text('{"epochs": 3}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")  # the user's own file, named by the user: followed
    assert rundir.read_config_file(tmp_path / "link.json") == {"epochs": 3}


# ------------------------------------------------------------------------------------------------- writers


def test_inspect_gates_writes_over_links_in_inspect_never_through_them(bayes_run, tmp_path, capsys, outside):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    (run / "inspect").mkdir()
    for name in ("summary.txt", "elbo.png"):
        (run / "inspect" / name).symlink_to(outside)
    assert inspect_gates.main([str(run)]) == 0, capsys.readouterr().err
    assert outside.read_text() == "keep\n"
    assert not (run / "inspect" / "summary.txt").is_symlink() and (run / "inspect" / "elbo.png").read_bytes()[:4] \
        == b"\x89PNG"
    # a linked inspect/ folder is refused, one that is a file named
    shutil.rmtree(run / "inspect")
    (run / "inspect").symlink_to(tmp_path, target_is_directory=True)
    assert inspect_gates.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'inspect'} is a symbolic link, to {tmp_path}; a folder inside the run folder {run} is the "
        "run's however it is named, and nothing is written through a link into a run folder (it may point anywhere): "
        "move it away, or pass another --out")
    (run / "inspect").unlink()
    (run / "inspect").write_text("mine")
    assert inspect_gates.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'inspect'} is a file, not a folder; move it away, or pass another --out")


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_inspect_gates_on_a_read_only_or_full_disk_is_one_line(bayes_run, tmp_path, capsys, monkeypatch, code):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    real = os.open

    def failing(path, flags, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(code, os.strerror(code))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)
    assert inspect_gates.main([str(run)]) == 2
    fix = "choose another --out, in a folder you can write" if code == errno.EROFS else \
        "free some space or choose another --out"
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: cannot write {run / 'inspect' / 'elbo.png'}: {os.strerror(code)}; {fix} (any previous elbo.png is "
        "unchanged)")


def test_report_writes_into_a_real_folder_over_links_never_through_them(bayes_run, tmp_path, capsys, outside):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere, target_is_directory=True)
    assert report_script.main([str(run)]) == 2
    assert "report is a symbolic link" in _one_error_line(capsys.readouterr().err) and not list(elsewhere.iterdir())
    (run / "report").unlink()
    (run / "report").mkdir()
    (run / "report" / "index.html").symlink_to(outside)
    assert report_script.main([str(run)]) == 0, capsys.readouterr().err
    assert outside.read_text() == "keep\n" and (run / "report" / "index.html").read_text().startswith("<!doctype html>")


def test_a_folder_in_the_place_of_a_file_to_write_is_one_line(bayes_run, tmp_path, capsys):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    (run / "report" / "index.html").mkdir(parents=True)
    assert report_script.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: cannot write {run / 'report' / 'index.html'}: Is a directory; move it away or choose another --out "
        "(report.json, index.html are as they were)")
    assert sorted(p.name for p in (run / "report").iterdir()) == ["index.html"]


def test_conflict_records_of_other_keys_are_one_line(bayes_run, tmp_path, capsys):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    with open(run / "conflict.jsonl", "a") as f:
        f.write('{"step": 3}\n')  # a record without the per-dimension scores
    assert inspect_gates.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'conflict.jsonl'} holds records that are not conflict records of one run (their keys or "
        "lengths differ); move it away")
    assert not (run / "inspect").exists()


@pytest.mark.parametrize("record, cause", [('{"step": 3, "loss": "x"}', "ValueError: could not convert string to "
                                                                         "float: 'x'"),
                                           ('{"step": 3}', "KeyError: 'loss'")])
def test_log_records_of_other_values_are_one_line(bayes_run, tmp_path, capsys, record, cause):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    with open(run / "log.jsonl", "a") as f:
        f.write(record + "\n")
    assert report_script.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: the run's log.jsonl holds records that are not what a run writes ({cause}); move it away")


def test_a_page_and_its_json_are_replaced_together_or_not_at_all(tmp_path):
    """A full disk while writing the second of two files (report.json, index.html; the backbone and the head) leaves
    both as they were and no temporary file."""
    first, second = tmp_path / "report.json", tmp_path / "index.html"
    first.write_text("old json")
    second.write_text("old page")

    def full(f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError, match=re.escape(
            f"cannot write {second}: No space left on device; free some space or choose another --out (report.json, "
            "index.html are as they were)")):
        rundir.save_together([(b"new json", first), (full, second)])
    assert first.read_text() == "old json" and second.read_text() == "old page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html", "report.json"]


@pytest.mark.parametrize("name, kind", [*(("log.jsonl", kind) for kind in KINDS), ("conflict.jsonl", "link")])
def test_a_resumed_run_appends_to_no_link_or_fifo(unfinished, outside, name, kind):
    begins = _plant(unfinished / name, kind, outside).removeprefix("error: ")
    with pytest.raises(UserError) as err:
        Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False).fit()
    assert str(err.value).startswith(begins) and outside.read_text() == "keep\n"


def test_a_checkpoint_is_saved_over_a_link_never_through_it(unfinished, outside):
    (unfinished / "checkpoint.pt").rename(unfinished / "saved.pt")
    (unfinished / "checkpoint.pt").symlink_to(outside)
    with pytest.raises(UserError, match="checkpoint.pt is a symbolic link"):  # read on resume: refused
        Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False)
    rundir.atomic_save({"w": torch.zeros(2)}, unfinished / "checkpoint.pt")  # replaced: the link itself
    assert outside.read_text() == "keep\n" and not (unfinished / "checkpoint.pt").is_symlink()


def test_compare_record_writes_over_links_in_the_record_never_through_them(bayes_run, tmp_path, outside):
    folder = tmp_path / "record" / "run-seed0"
    folder.mkdir(parents=True)
    (folder / "log.jsonl").symlink_to(outside)
    record(bayes_run, folder)
    assert outside.read_text() == "keep\n" and (folder / "log.jsonl").read_bytes() == (bayes_run / "log.jsonl") \
        .read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "eval.json", "log.jsonl"]


def test_export_writes_no_file_of_a_run(bayes_run, ncl_run, tmp_path, capsys):
    a, b = shutil.copytree(bayes_run, tmp_path / "a"), shutil.copytree(ncl_run, tmp_path / "b")
    before = {p: p.read_bytes() for run in (a, b) for p in run.iterdir() if p.is_file()}
    for args, flag, path in [(["--out", str(b / "checkpoint.pt")], "--out", b / "checkpoint.pt"),
                             (["--out", str(a / "gates.nc"), "--head-out", str(a / "x.pt")], "--out", a / "gates.nc"),
                             (["--head-out", str(a / "log.jsonl")], "--head-out", a / "log.jsonl")]:
        assert export_script.main([str(a), *args]) == 2
        assert _one_error_line(capsys.readouterr().err) == (
            f"error: {flag} {path}: {path.name} is the name of a file that a run keeps in its folder, and an export "
            "never replaces one (of this run or another); name it otherwise, e.g. backbone.pt")
    assert {p: p.read_bytes() for run in (a, b) for p in run.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_export_leaves_the_old_pair_and_no_temporary_file(ncl_run, tmp_path, monkeypatch,
                                                                              capsys, signum):
    """SIGTERM (which ended the process on the spot, leaving *.pid.tmp) and Ctrl-C (which left a new backbone
    beside an old head), arriving once the backbone's temporary file is written."""
    out = tmp_path / "weights"
    out.mkdir()
    (out / "backbone.pt").write_text("old backbone")
    (out / "backbone_head.pt").write_text("old head")
    real, handler = torch.save, signal.getsignal(signal.SIGTERM)

    def save_then_signal(obj, f):
        real(obj, f)
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(torch, "save", save_then_signal)
    status = export_script.main([str(ncl_run), "--out", str(out / "backbone.pt")])
    err = capsys.readouterr().err
    assert (status, err) == ((75, "stopped: SIGTERM received; the two files are both written or both as they were, and "
                                  "no temporary file is left\n") if signum == signal.SIGTERM else
                             (130, "stopped: interrupted\n"))
    assert sorted(p.name for p in out.iterdir()) == ["backbone.pt", "backbone_head.pt"]
    assert (out / "backbone.pt").read_text() == "old backbone" and (out / "backbone_head.pt").read_text() == "old head"
    assert signal.getsignal(signal.SIGTERM) == handler  # the script's handler is for its run only


# ------------------------------------------------------------------------------------------------ the lock


def test_a_linked_run_lock_is_refused_and_its_target_untouched(unfinished, outside):
    (unfinished / "run.lock").unlink()
    (unfinished / "run.lock").symlink_to(outside)
    with pytest.raises(UserError, match=re.escape(f"{unfinished / 'run.lock'} is a symbolic link, to {outside}")):
        Trainer(fast(unfinished, max_steps=4), progress=False)
    assert outside.read_text() == "keep\n"


@pytest.mark.parametrize("how", ["a folder named run.lock", "permission denied"])
def test_a_lock_that_cannot_be_taken_refuses_the_run(unfinished, monkeypatch, capsys, how):
    """Another user's run.lock in a shared folder (or one made immutable, chattr +i) cannot be opened for writing:
    two runs trained at once, every step twice in log.jsonl. Now the run is refused, having written nothing."""
    lock = unfinished / "run.lock"
    if how == "a folder named run.lock":
        lock.unlink()
        lock.mkdir()
        reason = "Is a directory"
    else:
        real = rundir.beneath.open_beneath  # a file of a run is opened below its folder's descriptor, the lock too

        def refused(dir_fd, names, flags, *args, **kwargs):
            if tuple(names) == (lock.name,):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            return real(dir_fd, names, flags, *args, **kwargs)

        monkeypatch.setattr(rundir.beneath, "open_beneath", refused)
        reason = os.strerror(errno.EACCES)
    log = (unfinished / "log.jsonl").read_text()
    assert run_svi.main([*TINY_RUN, "--out", str(unfinished)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: cannot lock {unfinished}: {lock} cannot be opened for writing ({reason}), and without its lock a "
        "second run could train in the folder at the same time; choose another --out, in a folder you can write")
    assert (unfinished / "log.jsonl").read_text() == log


# ----------------------------------------------------------------------------------------- a run's marker


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_project_whose_config_json_names_a_dataset_is_no_run(tmp_path, capsys, overwrite):
    """A user's project (with .git) whose config.json holds dataset, lr, epochs, batch_size was taken for a run that
    wrote no checkpoint, and everything in it, .git too, moved into previous-*/."""
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "config.json").write_text('{"dataset": "digits", "lr": 0.1, "epochs": 3, "batch_size": 64}')
    assert run_svi.main([*TINY_RUN, "--out", str(project), *overwrite]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {project} holds files that are not a bayesncl-pyro run (.git, config.json); pass a new or empty --out "
        "(--overwrite moves only an earlier run's files aside)")
    assert sorted(p.name for p in project.iterdir()) == [".git", "config.json"]


def test_a_run_from_before_the_marker_is_known_by_its_checkpoint(unfinished):
    (unfinished / "bayesncl-pyro.run").unlink()
    trainer = Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False)
    assert trainer.step == 2 and (unfinished / "bayesncl-pyro.run").read_text().startswith("bayesncl-pyro run folder")
    del trainer


def test_a_users_file_named_like_a_temporary_one_is_kept(unfinished, tmp_path, capsys):
    (unfinished / "config.json.draft.tmp").write_text("mine")
    (unfinished / "config.json.4321.tmp").write_text('{"da')  # a run's, killed mid-write: removed
    trainer = Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False)
    del trainer
    assert (unfinished / "config.json.draft.tmp").read_text() == "mine"
    assert not (unfinished / "config.json.4321.tmp").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json.draft.tmp").write_text("mine")  # not a run's folder: refused, not emptied
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "mine")]) == 2
    assert "holds files that are not a bayesncl-pyro run (config.json.draft.tmp)" in capsys.readouterr().err


def test_a_cut_short_log_line_is_left_out_with_a_note_and_the_next_line_stays_whole(tmp_path, caplog):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # a run killed while writing its second record
    rundir.append_line('{"step": 2, "loss": 0.5}', log)  # the rerun's
    assert rundir.read_log(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    assert caplog.messages == [f"note: {log}: 1 line(s) are not records of a run (the first: line 2; a run killed "
                               "while writing one leaves it cut short); they are left out"]
