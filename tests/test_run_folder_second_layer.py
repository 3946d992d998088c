"""The run-folder rule (bayesncl_pyro/rundir/), its second layer: what lay just past the first. Hard
links, the names a foreign-file check skipped, every writer (compare.py, a late swap of inspect/) under the rule, the
code a --config from a run folder names, and readers whose memory is bounded. docs/RELIABILITY.md maps each to its
test."""

import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, fast, make_tree

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import compare, inspect_gates, run_svi
from bayesncl_pyro.cli import export as export_script
from bayesncl_pyro.cli import report as report_script
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import figures
from bayesncl_pyro.train.trainer import Trainer


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file of the user's outside the run folder, which nothing may write into."""
    path = tmp_path / "secret.txt"
    path.write_text("keep\n")
    return path


def _hard_linked(path: Path) -> str:
    return (f"{path} has 2 hard links, so it is also a file elsewhere; a run never writes into a file it shares (the "
            "other name would change too): replace it by a copy of its own (cp FILE FILE.new && mv FILE.new FILE), "
            "or move it away")


# ---------------------------------------------------------------------------------------------------- HIGH


def test_a_hard_linked_run_lock_is_refused_and_the_file_it_shares_untouched(unfinished, outside):
    """ln OUTSIDE RUN/run.lock: the lock was opened read-write and truncated, the outside file then held
    'process N on HOST'."""
    (unfinished / "run.lock").unlink()
    os.link(outside, unfinished / "run.lock")
    log = (unfinished / "log.jsonl").read_bytes()
    with pytest.raises(UserError) as err:
        Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False)
    assert str(err.value) == _hard_linked(unfinished / "run.lock")
    assert outside.read_text() == "keep\n" and (unfinished / "log.jsonl").read_bytes() == log


@pytest.mark.parametrize("name", ["log.jsonl", "conflict.jsonl"])
def test_a_resumed_run_appends_to_no_hard_linked_file(unfinished, outside, name):
    """A hard-linked log.jsonl or conflict.jsonl was appended to in place on resume: the records landed in the outside
    file (O_NOFOLLOW does not see hard links)."""
    (unfinished / name).unlink()
    os.link(outside, unfinished / name)
    with pytest.raises(UserError) as err:
        Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False).fit()
    assert str(err.value) == _hard_linked(unfinished / name) and outside.read_text() == "keep\n"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_of_files_named_like_ours_is_not_taken_for_a_run(tmp_path, capsys, overwrite):
    """A user's folder holding only checkpoint.pt.2024.tmp, config.json.1.tmp and previous-drafts/ counted as empty
    (temporary and previous-* names were skipped): it was claimed and the two files deleted."""
    mine = tmp_path / "mine"
    (mine / "previous-drafts").mkdir(parents=True)
    (mine / "previous-drafts" / "notes.txt").write_text("draft")
    (mine / "checkpoint.pt.2024.tmp").write_text("mine")
    (mine / "config.json.1.tmp").write_text("mine too")
    (mine / "run.lock").write_text("my notes on locks\n")  # not a lock as a run leaves it: the user's, not truncated
    assert run_svi.main([*TINY_RUN, "--out", str(mine), *overwrite]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {mine} holds files that are not a bayesncl-pyro run (checkpoint.pt.2024.tmp, config.json.1.tmp, "
        "previous-drafts, run.lock); pass a new or empty --out (--overwrite moves only an earlier run's files aside)")
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoint.pt.2024.tmp", "config.json.1.tmp", "previous-drafts",
                                                      "run.lock"]
    assert (mine / "run.lock").read_text() == "my notes on locks\n"
    assert (mine / "checkpoint.pt.2024.tmp").read_text() == "mine" and (mine / "config.json.1.tmp").read_text() == \
        "mine too" and (mine / "previous-drafts" / "notes.txt").read_text() == "draft"


def test_compare_writes_over_links_in_its_out_never_through_them(compared, tmp_path, capsys):
    """Rerun with the same --out after comparison.md, comparison.json or a figure were made links: the targets were
    overwritten (write_text, savefig)."""
    args, root = compared
    out = root / "out"
    names = ["comparison.md", "comparison.json", "consistency_vs_probe.png", "matched_sparsity.png"]
    for name in names:
        (tmp_path / name).write_text("keep\n")
        (out / name).unlink()
        (out / name).symlink_to(tmp_path / name)
    assert compare.main(args) == 0, capsys.readouterr().err
    for name in names:
        assert (tmp_path / name).read_text() == "keep\n" and not (out / name).is_symlink()
    assert (out / "consistency_vs_probe.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "comparison.json").read_text())["runs"][0]["name"] == "ncl"


def test_inspect_writes_nothing_through_an_inspect_folder_swapped_for_a_link_while_it_works(bayes_run, tmp_path,
                                                                                           capsys, monkeypatch):
    """inspect/ was checked once, about 10 s before the writes: replacing it with a link in that window sent every
    figure and summary.txt to the link's target."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = figures.test_features

    def then_swap(*args, **kwargs):
        features = real(*args, **kwargs)
        (run / "inspect").rename(tmp_path / "moved")
        (run / "inspect").symlink_to(elsewhere, target_is_directory=True)
        return features

    monkeypatch.setattr(figures, "test_features", then_swap)
    assert inspect_gates.main([str(run)]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'inspect'} is a symbolic link, to {elsewhere}; a folder inside the run folder {run} is the "
        "run's however it is named, and nothing is written through a link into a run folder (it may point anywhere): "
        "move it away, or pass another --out")
    assert not list(elsewhere.iterdir()) and not list((tmp_path / "moved").iterdir())


@pytest.mark.parametrize("field, spec", [("encoder", "run_gadget:small"), ("prior", "run_gadget:Prior")])
def test_a_config_from_a_run_folder_imports_no_code_unless_trusted(bayes_run, tmp_path, gadget_module, capsys, field,
                                                                   spec):
    """--config RUN/config.json (the README's way to rerun a run) ran the code its config named: "os:abort" aborted,
    "this:Prior" imported a module; report.py refuses the same config without --trust-run."""
    run = shutil.copytree(bayes_run, tmp_path / "theirs")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, field: spec}))
    args = ["--config", str(run / "config.json"), "--max-steps", "2", "--out", str(tmp_path / "mine")]
    assert run_svi.main(args) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {run / 'config.json'} names code that opening it would import and run: {field} {spec} (module "
        "run_gadget); open it with --trust-run (trust_code=True in Python) only if you trust whoever wrote the run")
    assert not gadget_module.exists() and not (tmp_path / "mine").exists()
    # trusted, or the same file outside a run folder (the user's own), or the code named on the command line: taken
    mine = shutil.copy(run / "config.json", tmp_path / "mine.json")
    for argv in (["--config", str(run / "config.json"), "--trust-run"], ["--config", str(mine)],
                 ["--config", str(run / "config.json"), f"--{field}", spec]):
        assert getattr(run_svi.config(argv)[0], field) == spec


# ----------------------------------------------------------------------------------------------------- MED


def test_compare_reads_no_linked_run_folder_inside_its_record(compared, tmp_path, capsys):
    """compare.py --record REC read linked run folders inside REC: an outside eval.json's numbers appeared in
    comparison.md."""
    args, root = compared
    record = shutil.copytree(root / "record", tmp_path / "record")
    forged = shutil.copytree(record / "ncl-seed0", tmp_path / "forged")
    evaluation = json.loads((forged / "eval.json").read_text())
    (forged / "eval.json").write_text(json.dumps({**evaluation, "linear_probe_top1": 0.123456}))
    shutil.rmtree(record / "ncl-seed0")
    (record / "ncl-seed0").symlink_to(forged, target_is_directory=True)
    out = tmp_path / "out"
    argv = [*args[:args.index("--out")], "--out", str(out), "--record", str(record)]
    assert compare.main(argv) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {record / 'ncl-seed0'} is a symbolic link, to {forged}; a folder inside a run folder or a record is "
        "never read or written through one (it may point anywhere): move it away")
    assert not (out / "comparison.md").exists()


def _shared_list(depth: int) -> list:
    """A list that names 2^depth items in a few bytes of pickle: each level holds the one below twice."""
    items = ["x"]
    for _ in range(depth):
        items = [items, items]
    return items


def _capped(code: str, memory: int = 4 * 2**30, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by this Python in a process of its own, under an address-space cap of ``memory`` bytes."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cap, cwd=Path(__file__).parent)


@pytest.mark.parametrize("reader", ["resume", "report.py"])
def test_a_checkpoint_whose_config_holds_a_shared_reference_bomb_is_one_line(unfinished, reader):
    """A checkpoint whose config.out is a list of shared references (about 1 KB in the file, 2^40 items walked)
    exhausted the memory on resume and in report.py (dataclasses.asdict)."""
    state = torch.load(unfinished / "checkpoint.pt", weights_only=True)
    state["config"]["out"] = _shared_list(40)
    torch.save(state, unfinished / "checkpoint.pt")
    run = (f"one_line_errors(lambda: Trainer(fast(Path({str(unfinished)!r}), max_steps=4, conflict_every=1), "
           "progress=False) and 0)()" if reader == "resume" else f"report.main([{str(unfinished)!r}])")
    done = _capped("import sys; from pathlib import Path; from helpers import fast; from bayesncl_pyro.cli import "
                   "one_line_errors, report; from bayesncl_pyro.train.trainer import Trainer; "
                   f"sys.exit({run})")
    assert done.returncode == 2, done.stderr[-2000:]
    assert _one_error_line(done.stderr) == (
        f"error: the config in {unfinished / 'checkpoint.pt'} holds more than 1,000,000 values (a list that holds "
        "another many times over); a run's config holds a few dozen: it is not what a run writes, move it away")


def _gates_file(path: Path, make):
    """An HDF5 file at ``path`` that h5netcdf reads as netCDF: the dataset ``make(f)`` creates is a coordinate."""
    import h5py

    with h5py.File(path, "w") as f:
        make(f)
        f["x"].make_scale("x")


def test_read_gates_follows_no_external_storage_and_caps_what_it_decompresses(tmp_path):
    """read_gates followed an HDF5 external-storage variable to a file outside the run (returning its bytes), and a
    6.8 MB gates.nc of compressed zeros made it allocate 6 GiB."""
    import h5py

    from bayesncl_pyro.evaluate.arviz_export import read_gates

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret bytes")
    run = tmp_path / "run"
    run.mkdir()
    _gates_file(run / "gates.nc", lambda f: f.create_dataset("x", shape=(12,), dtype="u1",
                                                               external=[(str(secret), 0, 12)]))
    with pytest.raises(UserError) as err:
        read_gates(run)
    assert str(err.value) == (
        f"{run / 'gates.nc'}: its variable /x keeps its data in another file (HDF5 external storage), which a run's "
        "gates.nc never does (it may be any file): it is not what a run writes, move it away")

    def virtual(f):
        layout = h5py.VirtualLayout(shape=(12,), dtype="u1")
        layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "data", shape=(12,))
        f.create_virtual_dataset("x", layout)

    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["data"] = list(b"secret bytes")
    _gates_file(run / "gates.nc", virtual)
    with pytest.raises(UserError, match="its variable /x is a virtual dataset"):
        read_gates(run)
    _gates_file(run / "gates.nc", lambda f: f.create_dataset("x", shape=(2**28,), dtype="u1", chunks=(2**22,),
                                                               compression="gzip", compression_opts=9))
    size = (run / "gates.nc").stat().st_size
    assert size < 2**20
    with pytest.raises(UserError) as err:
        read_gates(run)
    assert str(err.value) == (
        f"{run / 'gates.nc'} holds {size:,} bytes that decompress to 268,435,456, more than the "
        f"{64 * size + 64 * 2**20:,} a gates.nc of its size is read up to; it is not what a run writes, move it away")


IMAGES = ["--dataset", "imagefolder", "--encoder", "cnn", "--image-size", "8"]


def test_a_run_folder_in_the_data_folder_by_another_path_is_refused(tmp_path, monkeypatch, capsys):
    """The data-folder check compared paths only: a bind mount of the data put a run folder inside the data set (and
    every later run on it failed). A stand-in for the mount: the folder `alias` answers os.stat as the data folder
    (a bind mount shows the same device and inode under two paths); test_..._under_a_real_bind_mount mounts one."""
    data = make_tree(tmp_path / "imgdata", {"train": ["a"], "val": ["a"]})
    alias = tmp_path / "alias"
    (alias / "train").mkdir(parents=True)
    real_stat = os.stat

    def bind_mounted(path, *args, **kwargs):
        return real_stat(data if Path(path) == alias else path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", bind_mounted)
    assert run_svi.main([*IMAGES, "--data-dir", str(data), "--out", str(alias / "train" / "newrun")]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: --out {alias / 'train' / 'newrun'} is inside the data folder ({data}), by another path; a run needs a "
        "folder of its own: pass e.g. --out runs/NAME")
    assert not (alias / "train" / "newrun").exists()


def test_a_run_folder_in_the_data_folder_under_a_real_bind_mount_is_refused(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to mount the data folder a second time")
    data, alias = make_tree(tmp_path / "imgdata", {"train": ["a"], "val": ["a"]}), tmp_path / "alias"
    alias.mkdir()
    script = (f"mount --bind {data} {alias} && cd {Path(__file__).parent} && {sys.executable} -c "
              "\"import sys; from bayesncl_pyro.cli import run_svi; "
              f"sys.exit(run_svi.main({IMAGES!r} + ['--data-dir', '{data}', '--out', '{alias}/train/newrun']))\"")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120)
    if "mount" in done.stderr and done.returncode not in (0, 2):
        pytest.skip(f"no bind mount here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert _one_error_line(done.stderr) == (
        f"error: --out {alias}/train/newrun is inside the data folder ({data}), by another path; a run needs a folder "
        "of its own: pass e.g. --out runs/NAME")
    assert not (data / "train" / "newrun").exists()


def test_a_small_file_is_read_without_reserving_its_limit(tmp_path):
    """read_bytes called f.read(limit + 1), which reserved the whole limit (1 GiB for a 440-byte log): report.py and
    inspect_gates.py failed under a 4 GB address-space cap where run_svi.py ran."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n' * 17)  # 442 bytes
    tracemalloc.start()
    try:
        assert rundir.read_bytes(log, rundir.TEXT_LIMIT) == log.read_bytes()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


@pytest.mark.slow  # draws every figure in a capped subprocess (10 s)
def test_inspect_gates_runs_under_a_4_gb_address_space_cap(bayes_run, tmp_path):
    run = shutil.copytree(bayes_run, tmp_path / "run")
    done = _capped("import sys; from bayesncl_pyro.cli import inspect_gates; "
                   f"sys.exit(inspect_gates.main([{str(run)!r}]))", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "inspect" / "summary.txt").exists()


@pytest.mark.slow  # writes and reads a log of a few hundred MB (6 s)
def test_a_log_of_tiny_records_is_read_in_bounded_memory(tmp_path):
    """A log of {"step":1} lines cost about 27 times its size in memory: a 320 MiB log, under the 1 GiB cap, failed
    report.py under 6.5 GB. Read a line at a time, at most a million records."""
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"step":1}\n' * 1_000_001)
    with pytest.raises(UserError) as err:
        rundir.read_log(tmp_path)
    assert str(err.value) == (
        f"{log} holds more than 1,000,000 records, more than a run writes (one every --log-every steps); it is not "
        "what a run writes: move it away")
    log.write_bytes(b'{"step":1}\n' * 100_000)  # 1.1 MB: what it costs beside its records
    tracemalloc.start()
    try:
        records = rundir.read_log(tmp_path)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(records) == 100_000 and peak - held < 2**20


@pytest.mark.slow  # writes and reads a log of a few hundred MB (7 s)
def test_a_log_of_lines_that_are_no_records_is_read_in_bounded_memory(tmp_path, caplog):
    """Each such line's number was kept, about 35 bytes a line: a 1 GiB log of them some 18 GiB. Now a count."""
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"step":1}\n' + b"x\n" * 200_000)
    tracemalloc.start()
    try:
        records = rundir.read_log(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert records == [{"step": 1}] and peak < 2**20
    assert f"note: {log}: 200000 line(s) are not records of a run (the first: line 2;" in caplog.text


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_export_replaces_no_file_that_is_not_a_regular_one(ncl_run, tmp_path, capsys, kind):
    """export.py --out onto a device or any non-regular file replaced it by a rename."""
    target = tmp_path / "b.pt"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
        sock.close()
    assert export_script.main([str(ncl_run), "--out", str(target)]) == 2
    what = "a named pipe (FIFO)" if kind == "fifo" else "a socket"
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: cannot write {target}: it is {what}, not a regular file; pass a regular file or a new name")
    mode = os.lstat(target).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISSOCK(mode))
    assert not (tmp_path / "b_head.pt").exists()


# ----------------------------------------------------------------------------------------------------- LOW


def test_export_writes_nothing_into_the_files_a_run_keeps_in_its_folder(bayes_run, ncl_run, tmp_path, capsys):
    """export.py --out B/report/index.html replaced another run's files: the check looked at the last name only."""
    a, b = shutil.copytree(bayes_run, tmp_path / "a"), shutil.copytree(ncl_run, tmp_path / "b")
    (b / "report").mkdir()
    (b / "report" / "index.html").write_text("the page")
    for out in (b / "report" / "index.html", b / "previous-1" / "weights.pt"):
        assert export_script.main([str(a), "--out", str(out)]) == 2
        folder = b / out.relative_to(b).parts[0]
        assert _one_error_line(capsys.readouterr().err) == (
            f"error: --out {out}: it lies in {folder}, which the run in {b} keeps, and an export never writes into a "
            f"run's files (of this run or another); name a path outside it, e.g. {b / 'backbone.pt'}")
    assert (b / "report" / "index.html").read_text() == "the page" and not (b / "previous-1").exists()
    assert sorted(p.name for p in (b / "report").iterdir()) == ["index.html"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_marker_in_a_project_folder_is_suspect(tmp_path, capsys, overwrite):
    """--overwrite on a project folder with a forged marker moved .git and the sources into previous-*; without it the
    run trained beside the user's files."""
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    (project / "bayesncl-pyro.run").write_text("bayesncl-pyro run folder, forged\n")
    assert run_svi.main([*TINY_RUN, "--out", str(project), *overwrite]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {project} holds our marker bayesncl-pyro.run, but also .git, train.py, which no run writes (a "
        "repository, source files): a marker there is not a run's; pass a new or empty --out, or move them away")
    assert sorted(p.name for p in project.iterdir()) == [".git", "bayesncl-pyro.run", "train.py"]


def test_a_run_config_of_many_unknown_keys_is_one_short_line(unfinished, capsys):
    """A config with 300k unknown keys printed one 48.6 MB error line."""
    config = json.loads((unfinished / "config.json").read_text())
    (unfinished / "config.json").write_text(json.dumps({**config, **{f"key_{i:06d}_" + "x" * 150: 1
                                                                     for i in range(300_000)}}))
    with pytest.raises(UserError) as err:
        Trainer(fast(unfinished, max_steps=4, conflict_every=1), progress=False)
    message = str(err.value)
    assert len(message) < 1000 and message.startswith("config has unknown keys ['key_000000_xxx") and (
        "and 299,996 more]: it was written by another version of bayesncl-pyro; start a new --out folder") in message


def test_a_wandb_run_id_that_is_no_id_is_refused_as_not_a_runs(tmp_path, monkeypatch):
    """A refused wandb/run_id with '..' advised `wandb login`."""
    from bayesncl_pyro.loggers import WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "run_id").write_text("../../elsewhere\n")
    with pytest.raises(UserError) as err:
        WandbLog(tmp_path, {})
    assert str(err.value) == (
        f"{tmp_path / 'wandb' / 'run_id'} holds '../../elsewhere', not a W&B run id (letters, digits, - and _, as a "
        "run writes it); it is not what a run writes: move it away, and a new W&B run starts")


def test_every_writer_into_a_run_folder_respects_a_held_lock(bayes_run, tmp_path, capsys, holder):
    """Writers other than the trainer ignored a held run.lock: inspect_gates.py --export rewrote gates.nc beside a
    training run (report.py and export.py wrote their files into its folder too)."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    shutil.rmtree(run / "report", ignore_errors=True)
    gates = (run / "gates.nc").read_bytes()
    process = holder(run)
    for main, argv in ((inspect_gates.main, [str(run), "--export", "--out", str(tmp_path / "figures")]),
                       (report_script.main, [str(run)]), (export_script.main, [str(run)])):
        assert main(argv) == 2
        assert _one_error_line(capsys.readouterr().err) == (
            f"error: {run} is in use by another run (process {process.pid} on {socket.gethostname()}); wait for it to "
            "end, or pass another --out")
    assert (run / "gates.nc").read_bytes() == gates and not (run / "report").exists()
    assert not (run / "backbone.pt").exists() and not (tmp_path / "figures").exists()


def test_the_temporary_files_a_killed_writer_left_are_removed_by_the_next(bayes_run, tmp_path, capsys):
    """Temporary files left by a SIGKILL in report.py, export.py and inspect_gates.py were never cleaned."""
    run = shutil.copytree(bayes_run, tmp_path / "run")
    left = [run / "report" / "index.html.99999.tmp", run / "report" / "report.json.99999.tmp",
            run / "inspect" / "elbo.png.4242.tmp", run / "inspect" / "summary.txt.4242.tmp",
            run / "backbone.pt.777.tmp", run / "backbone_head.pt.777.tmp", run / "gates.nc.31337.tmp"]
    for path in left:
        path.parent.mkdir(exist_ok=True)
        path.write_text("half written")
    (run / "report" / "notes.tmp").write_text("the user's")  # no temporary file of ours: kept
    assert inspect_gates.main([str(run), "--export"]) == 0, capsys.readouterr().err
    assert report_script.main([str(run)]) == 0, capsys.readouterr().err
    assert export_script.main([str(run)]) == 0, capsys.readouterr().err
    assert [path.name for path in left if path.exists()] == []
    assert (run / "report" / "notes.tmp").read_text() == "the user's"
