"""The run-folder rule (bayesncl_pyro/rundir/), its third layer: trust by where a file lies, a folder inside a run
folder however it is named, the records a resume takes back, and what compare.py --rebuild reads. docs/RELIABILITY.md
maps each to its test."""

import json
import os
import shutil
import socket

import pytest
from helpers import one_error_line

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import compare, export, inspect_gates, report, run_svi
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import comparison, figures
from bayesncl_pyro.evaluate.figures import inspect

REFUSED = ("names code that opening it would import and run: prior run_gadget:Prior (module run_gadget); open it with "
           "--trust-run (trust_code=True in Python) only if you trust whoever wrote the run")


def _naming_code(config: dict) -> bytes:
    return json.dumps({**config, "prior": "run_gadget:Prior"}).encode()


@pytest.mark.parametrize("where", ["record", "below a run", "another user's"])
def test_a_config_is_trusted_by_where_it_lies(bayes_run, tmp_path, gadget_module, capsys, where):
    """run_svi.py --config REC/run/config.json of a recorded run (config.json, eval.json, log.jsonl: no marker, no
    checkpoint) imported the code it named: trust came from a marker beside the file, not from where it lies."""
    config = json.loads((bayes_run / "config.json").read_text())
    if where == "record":  # what compare.py --record keeps of a run
        folder = tmp_path / "record" / "bayesncl-seed0"
        folder.mkdir(parents=True)
        for name in ("eval.json", "log.jsonl"):
            shutil.copy(bayes_run / name, folder / name)
    elif where == "below a run":  # an earlier run that --overwrite moved aside, in a run folder
        run = shutil.copytree(bayes_run, tmp_path / "theirs")
        folder = run / "previous-20240101-000000-x"
        folder.mkdir()
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        folder = tmp_path / "shared"
        folder.mkdir()
    path = folder / "config.json"
    path.write_bytes(_naming_code(config))
    if where == "another user's":
        os.chown(path, 4242, 4242)
    assert run_svi.main(["--config", str(path), "--max-steps", "2", "--out", str(tmp_path / "mine")]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {path} {REFUSED}"
    assert not gadget_module.exists() and not (tmp_path / "mine").exists()
    assert run_svi.config(["--config", str(path), "--trust-run"])[0].prior == "run_gadget:Prior"
    mine = tmp_path / "mine.json"  # the user's own copy, in a folder of the user's
    mine.write_bytes(path.read_bytes())
    assert run_svi.config(["--config", str(mine)])[0].prior == "run_gadget:Prior"


def _writers(run, name):
    """Each writer with --out ``RUN/<name>`` (a folder inside the run folder, named by the user)."""
    return [(report.main, [str(run), "--out", str(run / name)]),
            (inspect_gates.main, [str(run), "--out", str(run / name)]),
            (export.main, [str(run), "--out", str(run / name / "backbone.pt")])]


def test_a_linked_folder_inside_a_run_folder_is_refused_however_it_is_named(bayes_run, tmp_path, capsys):
    """--out RUN/report (report.py, inspect_gates.py, export.py) and the notebook's inspect(RUN, RUN / "inspect") wrote
    through a link that the default path refused: a typed path counted as the user's."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "sub").symlink_to(elsewhere, target_is_directory=True)
    refused = (f"{run / 'sub'} is a symbolic link, to {elsewhere}; a folder inside the run folder {run} is the run's "
               "however it is named, and nothing is written through a link into a run folder (it may point anywhere): "
               "move it away, or pass another --out")
    for main, argv in _writers(run, "sub"):
        assert main(argv) == 2, argv
        assert one_error_line(capsys.readouterr().err) == f"error: {refused}"
    with pytest.raises(UserError, match="is a symbolic link"):
        inspect(run, run / "sub" / "inspect")  # below the link: nothing is created through it either
    assert not list(elsewhere.iterdir())


def test_a_folder_inside_a_run_folder_is_written_under_the_runs_lock(bayes_run, tmp_path, capsys, holder):
    """--out RUN/report wrote into a folder whose training held the lock: the writers decided each for itself."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    process = holder(run)
    for main, argv in _writers(run, "mine"):
        assert main(argv) == 2, argv
        assert one_error_line(capsys.readouterr().err) == (
            f"error: {run} is in use by another run (process {process.pid} on {socket.gethostname()}); wait for it to "
            "end, or pass another --out")
    assert not (run / "mine").exists()


@pytest.mark.parametrize("how", ["relative", "absolute", "linked"])
def test_compare_rebuild_reads_no_run_folder_outside_its_record(compared, tmp_path, capsys, how):
    """compare.py --rebuild followed "folder": "../../../../home/private-run", an absolute folder and a record folder
    that is a link: the outside eval.json (with a private key) went whole into the rebuilt comparison.json."""
    record = shutil.copytree(compared[1] / "record", tmp_path / "record")
    private = shutil.copytree(record / "ncl-seed0", tmp_path / "private-run")
    (private / "eval.json").write_text(json.dumps({**json.loads((private / "eval.json").read_text()), "key": "secret"}))
    saved = json.loads((record / "comparison.json").read_text())
    name = {"relative": "../private-run", "absolute": str(private), "linked": "ncl-seed0"}[how]
    if how == "linked":
        shutil.rmtree(record / "ncl-seed0")
        (record / "ncl-seed0").symlink_to(private, target_is_directory=True)
    runs = [{**r, "folder": name} for r in saved["runs"]]
    (record / "comparison.json").write_text(json.dumps({**saved, "runs": runs}))
    before = (record / "comparison.json").read_bytes()
    assert compare.main(["--rebuild", str(record / "comparison.json")]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert err == (f"error: {record / 'ncl-seed0'} is a symbolic link, to {private}; a folder inside a run folder or a "
                   "record is never read or written through one (it may point anywhere): move it away"
                   if how == "linked" else
                   f"error: {record / 'comparison.json'} names the run folder {name!r}, which is not a folder of the "
                   f"record (a name in {record}, as --record writes it); it is not what compare.py writes: move it "
                   "away")
    assert (record / "comparison.json").read_bytes() == before
    assert "secret" not in (record / "comparison.md").read_text()


def test_compare_rebuild_reads_each_run_once_and_at_most_a_cap(compared, tmp_path, capsys, monkeypatch):
    """1,000 entries naming one run folder (120 KB) took 43 s and 0.95 GB: no cap, and each read again."""
    record = shutil.copytree(compared[1] / "record", tmp_path / "record")
    saved = json.loads((record / "comparison.json").read_text())
    (record / "comparison.json").write_text(json.dumps({**saved, "runs": saved["runs"] * 2}))
    assert compare.main(["--rebuild", str(record / "comparison.json")]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {record / 'comparison.json'} names the run folder 'ncl-seed0' twice; it is not what compare.py "
        "writes: move it away")
    monkeypatch.setattr(comparison, "MAX_RUNS", 1)
    (record / "comparison.json").write_text(json.dumps({**saved, "runs": [*saved["runs"], saved["runs"][0]]}))
    assert compare.main(["--rebuild", str(record / "comparison.json")]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {record / 'comparison.json'} names 2 runs, more than the 1 a comparison holds; it is not what "
        "compare.py writes: move it away")


def test_a_run_folder_swapped_for_a_link_during_an_export_sends_nothing_to_the_links_target(bayes_run, tmp_path,
                                                                                             monkeypatch):
    """During inspect_gates.py RUN --export, RUN swapped for a link (in a shared parent) sent gates.nc over the link's
    target's own file: the run folder was named again at each write."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gates.nc").write_text("the user's")
    real = figures.test_features

    def then_swap(*args, **kwargs):
        features = real(*args, **kwargs)
        run.rename(tmp_path / "moved")
        run.symlink_to(elsewhere, target_is_directory=True)
        return features

    monkeypatch.setattr(figures, "test_features", then_swap)
    inspect_gates.main([str(run), "--export"])
    assert sorted(p.name for p in elsewhere.iterdir()) == ["gates.nc"]
    assert (elsewhere / "gates.nc").read_text() == "the user's"
    assert (tmp_path / "moved" / "gates.nc").read_bytes()[:4] == b"\x89HDF"  # written into the folder it locked


def test_a_write_below_a_run_folder_never_goes_through_a_link(bayes_run, tmp_path):
    """rundir's writers called below a run folder that never went through output_folder (write_json(RUN/notes/x))
    wrote through a linked notes/."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "notes").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=f"^{run / 'notes'} is a symbolic link"):
        rundir.write_json({"a": 1}, run / "notes" / "x.json")
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_wandb_writes_no_run_through_a_hidden_wandb_folder(tmp_path, monkeypatch, kind):
    """W&B prefers RUN/.wandb where it exists: a resumed run from elsewhere wrote its whole W&B run through it (and
    replaced an outside debug.log with a symlink); only RUN/wandb was checked."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    from bayesncl_pyro.loggers import WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "debug.log").write_text("the user's")
    run = tmp_path / "run"
    run.mkdir()
    if kind == "link":
        (run / ".wandb").symlink_to(elsewhere, target_is_directory=True)
    else:
        (run / ".wandb").mkdir()
    with pytest.raises(UserError, match=f"^{run / '.wandb'} is not what a run writes, and W&B would write its run"):
        WandbLog(run, {})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["debug.log"] and not (run / "wandb").exists()


def test_a_log_with_a_line_longer_than_any_record_is_refused_without_reading_it_whole(tmp_path):
    """A sparse 1 GiB log (no disk) took 28 s and 2.85 GB to read; a log extended while read gave a MemoryError."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n')
    with open(log, "r+b") as f:
        f.truncate(2**30)  # a hole of NUL bytes: one line of a gigabyte
    with pytest.raises(UserError, match="a line of more than"):
        rundir.read_records(log)


def test_the_evaluation_table_never_sends_an_eval_jsons_control_characters_to_the_terminal():
    from bayesncl_pyro.evaluate.heldout import format_table

    table = format_table({"dims_tracking_\x1b]0;title\x07\x1b[2J": 3, "method": "bayesncl\x1b[31m"})
    assert "\x1b" not in table and "\x07" not in table and "\\x1b]0;title" in table


def test_writes_under_the_lock_look_for_stale_temporaries_once_a_file(tmp_path, monkeypatch):
    """Every write under the lock listed the whole folder for a killed writer's temporaries: 2.2 s a write in a
    folder of 400,000 files. Now once a file and process: the first write removes them, later ones list nothing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.MARKER).write_bytes(b"")
    (run / "eval.json.999999.tmp").write_bytes(b"left by a killed writer")
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda folder=".": listed.append(folder) or real(folder))
    with rundir.held(run):
        rundir.output_folder(run)
        rundir.write_json({"a": 1}, run / "eval.json")
        rundir.write_json({"a": 2}, run / "eval.json")
    assert not (run / "eval.json.999999.tmp").exists()
    assert len(listed) == 1 and json.loads((run / "eval.json").read_text()) == {"a": 2}


def test_a_comparison_fails_midway_and_leaves_its_previous_files_whole(compared, tmp_path, monkeypatch):
    """write_comparison renamed its json, each figure and its markdown one at a time: a failure on the second file
    (the first figure) left a new comparison.json beside the old comparison.md and figures."""
    out = shutil.copytree(compared[1] / "out", tmp_path / "out", symlinks=True)
    names = ["comparison.json", "consistency_vs_probe.png", "matched_sparsity.png", "comparison.md"]
    before = {name: (out / name).read_bytes() for name in names}
    report = {**json.loads(before["comparison.json"]), "wall_s": 1234.5}  # a new comparison: every file differs
    real, synced = os.fsync, []

    def full_on_the_second(fd):
        synced.append(fd)
        if len(synced) == 2:
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full_on_the_second)
    with pytest.raises(UserError) as refused:
        comparison.write_comparison(out, report)
    assert str(refused.value) == (f"cannot write {out / names[1]}: No space left on device; free some space or choose "
                                  f"another --out ({', '.join(names)} are as they were)")
    assert {name: (out / name).read_bytes() for name in names} == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(os, "fsync", real)
    comparison.write_comparison(out, report)  # and written whole when nothing fails
    assert json.loads((out / "comparison.json").read_text())["wall_s"] == 1234.5
    assert "20.6 min" in (out / "comparison.md").read_text()


def test_a_comparison_killed_between_its_renames_is_told_by_its_digests(compared, tmp_path, monkeypatch, capsys):
    """write_comparison renames its files one at a time (one rename for the set would change the folder's layout): a
    kill after the json's left a new comparison.json beside the old comparison.md, and nothing told them apart. The
    json names the digest of every other file; --rebuild says which do not match, and rewrites them."""
    record = shutil.copytree(compared[1] / "record", tmp_path / "record")
    path = record / "comparison.json"
    assert comparison.mismatched(path) == []
    report = {**json.loads(path.read_text()), "wall_s": 1234.5}  # another comparison.md
    report.pop("files")
    real, renamed = os.replace, []

    def killed_after_the_first(*args, **kwargs):  # the state a SIGKILL there leaves, but for the temporaries
        if renamed:
            raise KeyboardInterrupt
        renamed.append(real(*args, **kwargs))

    monkeypatch.setattr(os, "replace", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        comparison.write_comparison(record, report, figures=())
    monkeypatch.setattr(os, "replace", real)
    assert json.loads(path.read_text())["wall_s"] == 1234.5 and "20.6 min" not in (record / "comparison.md").read_text()
    assert comparison.mismatched(path) == ["comparison.md"]
    assert compare.main(["--rebuild", str(path)]) == 0
    assert (f"note: comparison.md in {record} are not the files written with comparison.json (a write of the "
            "comparison killed between its renames)") in capsys.readouterr().err
    assert comparison.mismatched(path) == [] and "20.6 min" in (record / "comparison.md").read_text()


@pytest.mark.parametrize("resolver", ["openat2", "a name at a time"])
def test_a_read_below_a_run_folder_goes_through_no_linked_folder(bayes_run, tmp_path, monkeypatch, resolver):
    """A file below a run folder was opened by its path: a folder on the way that is a link (a previous-* folder
    replaced by one) was followed, and a run folder swapped for a link while this process held its lock was read from
    the link's target. Both ways of opening below the run folder's descriptor: openat2 and, where the kernel lacks it,
    a name at a time with O_NOFOLLOW."""
    called = []
    if resolver == "openat2":
        if not rundir.beneath.OPENAT2:
            pytest.skip("this kernel (or its seccomp filter) has no openat2")
        real = rundir.beneath.openat2
        monkeypatch.setattr(rundir.beneath, "openat2", lambda *args: called.append(args[1]) or real(*args))
    else:
        monkeypatch.setattr(rundir.beneath, "OPENAT2", False)
        monkeypatch.setattr(rundir.beneath, "openat2", lambda *args: pytest.fail("openat2 was called"))
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = shutil.copytree(bayes_run, tmp_path / "elsewhere")
    (elsewhere / "eval.json").write_text(json.dumps({"secret": 1}))
    below = run / "previous-20240101-000000-x"
    below.symlink_to(elsewhere, target_is_directory=True)
    for read in (rundir.read_eval, rundir.read_log, lambda folder: rundir.read_json(folder / "config.json"),
                 lambda folder: rundir.load_checkpoint(folder / "checkpoint.pt")):
        with pytest.raises(UserError) as refused:
            read(below)
        assert str(refused.value) == (
            f"{below} is a symbolic link, to {elsewhere}; a file of a run folder is never read or written through one "
            "(it may point anywhere): replace the link by the folder, or move it away")
    assert rundir.read_eval(elsewhere) == {"secret": 1, "protocol": "fast"}  # the user named it: it may be anywhere
    with rundir.held(run):
        run.rename(tmp_path / "moved")
        run.symlink_to(elsewhere, target_is_directory=True)
        assert rundir.read_eval(run) == rundir.read_eval(tmp_path / "moved")  # from the folder it locked
        assert len(rundir.read_log(run)) == len(rundir.read_log(tmp_path / "moved"))
    assert rundir.read_eval(run) == {"secret": 1, "protocol": "fast"}  # the lock let go: the path the user names
    assert bool(called) == (resolver == "openat2")
