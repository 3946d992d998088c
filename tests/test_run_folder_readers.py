"""The run-folder rule (bayesncl_pyro/rundir/) for a reader of several files of one run without its lock: the run
folder is opened once (rundir.RunFolder) and every file is read below that descriptor, so that a run folder swapped
for a link to another run between two reads cannot give one reader the files of two runs. Each reader is tested both
ways of opening below a descriptor: openat2 and, where the kernel lacks it, a name at a time with O_NOFOLLOW.
docs/RELIABILITY.md maps each to its test."""

import json
import os
import shutil

import pytest

from bayesncl_pyro import rundir
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import comparison, figures, report
from bayesncl_pyro.evaluate.arviz_export import export_gates
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.train import plan


@pytest.fixture(params=["openat2", "a name at a time"])
def resolver(request, monkeypatch):
    """Open below a descriptor by openat2, or with it forced off (as where the kernel lacks it)."""
    if request.param == "openat2":
        if not rundir.beneath.OPENAT2:
            pytest.skip("this kernel (or its seccomp filter) has no openat2")
    else:
        monkeypatch.setattr(rundir.beneath, "OPENAT2", False)
        monkeypatch.setattr(rundir.beneath, "openat2", lambda *args: pytest.fail("openat2 was called"))
    return request.param


def _inodes(folder):
    """The inode of every file below ``folder``, by path relative to it."""
    return {os.stat(p).st_ino: p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _swapped_after_the_first_read(monkeypatch, run, elsewhere):
    """After the first file a reader opens, ``run`` is moved to RUN-moved and a link to ``elsewhere`` put in its place,
    as someone with write access to the parent could; returns the inodes of the files read, and the moved folder."""
    real, read = rundir.opening.open_regular, []
    moved = run.with_name(run.name + "-moved")

    def opening(*args, **kwargs):
        fd = real(*args, **kwargs)
        read.append(os.fstat(fd).st_ino)
        if len(read) == 1:
            run.rename(moved)
            run.symlink_to(elsewhere, target_is_directory=True)
        return fd

    monkeypatch.setattr(rundir.opening, "open_regular", opening)
    return read, moved


def _two_runs(bayes_run, tmp_path):
    """A copy of the run, and another run (its eval.json another's) the first is swapped for."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = shutil.copytree(bayes_run, tmp_path / "elsewhere")
    evaluation = json.loads((elsewhere / "eval.json").read_text())
    (elsewhere / "eval.json").write_text(json.dumps({**evaluation, "knn_top1": 0.123}))
    return run, elsewhere


def test_a_run_folder_held_open_reads_from_the_folder_it_opened(bayes_run, tmp_path, monkeypatch, resolver):
    """RunFolder itself: its reads, and every reader of a path below it while it is entered, come from the folder it
    opened; after it, the path the user names (a link: it may lead anywhere a user names)."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    with rundir.RunFolder.open(run) as kept:
        run.rename(tmp_path / "moved")
        run.symlink_to(elsewhere, target_is_directory=True)
        assert kept.read_eval()["knn_top1"] == rundir.read_eval(run)["knn_top1"] != 0.123
        assert kept.exists("checkpoint.pt") and rundir.exists(run / "eval.json") and not kept.exists("nothing")
        assert len(kept.read_log()) == len(rundir.read_log(tmp_path / "moved"))
        assert kept.load_checkpoint()["config"] == rundir.load_checkpoint(run / "checkpoint.pt")["config"]
    assert rundir.read_eval(run)["knn_top1"] == 0.123
    with rundir.RunFolder.open(tmp_path / "missing") as missing:  # no folder: the readers' own messages
        assert not missing.exists("eval.json") and missing.read_log() == []


def test_the_report_reads_one_run_folder(bayes_run, tmp_path, monkeypatch, resolver):
    """report.py read the checkpoint, then log.jsonl and eval.json, each by the run folder's path: a run folder swapped
    for a link to another run after the checkpoint put the other run's evaluation beside this run's gates."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    read, moved = _swapped_after_the_first_read(monkeypatch, run, elsewhere)
    data, _ = report.build(run)
    ours = _inodes(moved)
    assert {ours.get(inode, "elsewhere") for inode in read} == {"checkpoint.pt", "log.jsonl", "eval.json"}
    assert data["evaluation"]["knn_top1"] != 0.123


def test_a_written_report_reads_its_page_and_numbers_from_one_folder(bayes_run, tmp_path, monkeypatch, resolver):
    """Report(RUN) read report.json when made and index.html when shown, each by its path: the page of another run
    under this run's numbers. Both are read from one folder, when it is made."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    report.write_report(run)
    shutil.copytree(run / "report", elsewhere / "report", dirs_exist_ok=True)
    (elsewhere / "report" / "index.html").write_text("<p>another run's page</p>")
    read, moved = _swapped_after_the_first_read(monkeypatch, run, elsewhere)
    shown = report.Report(run)
    assert shown.page == (moved / "report" / "index.html").read_text()
    assert {_inodes(moved).get(inode, "elsewhere") for inode in read} == {"report/report.json", "report/index.html"}
    assert "another run's page" not in shown._repr_html_()


def test_inspect_reads_one_run_folder(bayes_run, tmp_path, monkeypatch, resolver):
    """inspect_gates.py --out elsewhere (no lock on the run) read the checkpoint, log.jsonl and conflict.jsonl each by
    the run folder's path."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    read, moved = _swapped_after_the_first_read(monkeypatch, run, elsewhere)
    figures.inspect(run, tmp_path / "figures")
    assert {_inodes(moved).get(inode, "elsewhere") for inode in read} == {"checkpoint.pt", "log.jsonl",
                                                                         "conflict.jsonl"}


def test_an_export_of_the_gates_writes_into_the_folder_it_read(bayes_run, tmp_path, monkeypatch, resolver):
    """export_gates(RUN) read the checkpoint, config.json and log.jsonl by the run folder's path, and wrote gates.nc
    under a lock taken by the path then: into the other run."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    theirs = (elsewhere / "gates.nc").read_bytes()
    old = os.stat(run / "gates.nc").st_ino
    read, moved = _swapped_after_the_first_read(monkeypatch, run, elsewhere)
    export_gates(run)
    assert {_inodes(moved).get(inode, "elsewhere") for inode in read} == {"checkpoint.pt", "config.json", "log.jsonl"}
    assert (elsewhere / "gates.nc").read_bytes() == theirs and os.stat(moved / "gates.nc").st_ino != old


def test_a_record_copies_one_run(bayes_run, tmp_path, monkeypatch, resolver):
    """compare.py --record copied config.json, eval.json and log.jsonl each by the run folder's path: a record of two
    runs."""
    run, elsewhere = _two_runs(bayes_run, tmp_path)
    read, moved = _swapped_after_the_first_read(monkeypatch, run, elsewhere)
    plan.record(run, tmp_path / "record" / "bayesncl-seed0")
    for name in plan.RECORD:
        assert (tmp_path / "record" / "bayesncl-seed0" / name).read_bytes() == (moved / name).read_bytes()
    assert {_inodes(moved).get(inode, "elsewhere") for inode in read} == set(plan.RECORD)


def test_compare_rebuild_reads_each_record_from_one_folder(compared, tmp_path, monkeypatch, resolver):
    """compare.py --rebuild read a recorded run's config.json, then its eval.json, each by its path."""
    record = shutil.copytree(compared[1] / "record", tmp_path / "record")
    saved = json.loads((record / "comparison.json").read_text())
    kept = record / saved["runs"][0]["folder"]
    elsewhere = shutil.copytree(kept, tmp_path / "elsewhere")
    evaluation = json.loads((elsewhere / "eval.json").read_text())
    (elsewhere / "eval.json").write_text(json.dumps({**evaluation, "knn_top1": 0.123}))
    real, swapped = rundir.opening.open_regular, []

    def opening(dir_fd, folder, names, *args, **kwargs):  # the comparison.json is read first: swap after the config
        fd = real(dir_fd, folder, names, *args, **kwargs)
        if names[-1] == "config.json" and not swapped:
            swapped.append(kept.rename(kept.with_name("moved")))
            kept.symlink_to(elsewhere, target_is_directory=True)
        return fd

    monkeypatch.setattr(rundir.opening, "open_regular", opening)
    runs = comparison.rebuild(record / "comparison.json")["runs"]
    assert swapped and runs[0]["knn_top1"] == evaluation["knn_top1"] != 0.123


def test_a_checkpoint_is_read_where_it_was_found(bayes_run, tmp_path, monkeypatch, resolver):
    """load_run checked that RUN/checkpoint.pt exists, then read it, each by the path: between the two, the run folder
    swapped for a link to a folder without one."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    (tmp_path / "empty").mkdir()
    real, swapped = rundir.reading.exists, []

    def found(path):
        there = real(path)
        if not swapped:
            swapped.append(run.rename(tmp_path / "moved"))
            run.symlink_to(tmp_path / "empty", target_is_directory=True)
        return there

    monkeypatch.setattr(rundir.reading, "exists", found)
    assert load_learner(run)[1].method == "bayesncl" and swapped


def test_a_linked_folder_inside_a_run_folder_is_not_opened_for_reading(bayes_run, tmp_path, resolver):
    """``RunFolder.open("RUN/report")`` (what ``Report`` reads) with RUN/report a link to a folder elsewhere is refused,
    naming the link, as a read of RUN/report/report.json by path is: nothing below it is read from elsewhere."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "report.json").write_text('{"planted": 1}')
    (elsewhere / "index.html").write_text("<p>planted</p>")
    (run / "report").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=r"report is a symbolic link"):
        rundir.read_json(run / "report" / "report.json")
    with pytest.raises(UserError, match=r"report is a symbolic link"):
        rundir.RunFolder.open(run / "report")
    with pytest.raises(UserError, match=r"report is a symbolic link"):
        report.Report(run / "report")
    real = tmp_path / "real"
    shutil.copytree(elsewhere, real)
    (run / "report").unlink()
    (run / "report").mkdir()
    shutil.copy(real / "report.json", run / "report" / "report.json")
    with rundir.RunFolder.open(run / "report") as opened:  # a real folder inside the run reads as before
        assert opened.read_json("report.json", rundir.TEXT_LIMIT) == {"planted": 1}


def test_a_run_folder_closed_inside_its_with_closes_at_its_end(bayes_run, tmp_path):
    """``close()`` while entered is deferred to the end of the ``with``: reads below the folder meanwhile never use a
    closed descriptor number (which the process may have given to another file)."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    with rundir.RunFolder.open(run) as opened:
        opened.close()
        assert opened.dir is not None
        assert rundir.read_json(run / "config.json", rundir.TEXT_LIMIT)["method"] == "bayesncl"
    assert opened.dir is None
