"""A run folder is data, the output folder is ours alone, and the last bad inputs are one line: opening someone
else's run imports none of its code and reads no pickle of its; a full disk, a second run on one folder, an --out
that is not a run's; hostile names in the report; bad numbers and files. docs/RELIABILITY.md maps each to its test."""

import json
import os
import pickle
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, fast, make_tree, write_cifar_pickles, write_image

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import export as export_script
from bayesncl_pyro.cli import inspect_gates, run_svi
from bayesncl_pyro.cli import report as report_script
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import report, report_data
from bayesncl_pyro.evaluate.run import load_run
from bayesncl_pyro.nn.encoders import build_backbone
from bayesncl_pyro.rundir import read_config_file
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer


class _Gadget:
    """A pickle that would run code: it writes the file MARKER names (the test's working folder)."""

    def __reduce__(self):
        return os.system, ("touch marker",)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------- a run folder is data


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny digits run (two steps), with a checkpoint."""
    out = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer(fast(out, max_steps=2), progress=False)
    trainer.train(2)
    trainer.save()
    return out


def _forged(trained: Path, folder: Path, **config) -> Path:
    """A copy of the trained run whose checkpoint's config says ``config``: what a run folder from elsewhere holds."""
    folder.mkdir(parents=True)
    state = torch.load(trained / "checkpoint.pt", weights_only=True)
    state["config"].update(config)
    torch.save(state, folder / "checkpoint.pt")
    (folder / "config.json").write_text(json.dumps(state["config"]))
    return folder


@pytest.mark.parametrize("field, spec", [("encoder", "run_gadget:small"), ("encoder", "this:s"),
                                         ("prior", "run_gadget:Prior"),
                                         ("prior", "timm:Prior")])  # timm: is an encoder's form, a prior's no
def test_code_a_run_names_is_refused_by_every_reader_unless_trusted(trained, tmp_path, gadget_module, capsys,
                                                                    monkeypatch, field, spec):
    run = _forged(trained, tmp_path / "theirs", **{field: spec})
    module = spec.partition(":")[0]
    monkeypatch.delitem(sys.modules, "this", raising=False)
    named = f"{field} {spec} (module {module})"
    with pytest.raises(UserError, match=re.escape(named) + ".*--trust-run \\(trust_code=True in Python\\)"):
        load_run(run)
    for main, argv in ((report_script.main, [str(run)]), (inspect_gates.main, [str(run)]),
                       (export_script.main, [str(run), "--out", str(tmp_path / "b.pt")])):
        assert main(argv) == 2
        err = capsys.readouterr()
        assert named in _one_error_line(err.err) and "Beautiful is better" not in err.out
    assert not gadget_module.exists() and "this" not in sys.modules


def test_trusting_a_run_names_what_it_imports_and_loads_it(trained, tmp_path, gadget_module, caplog):
    run = _forged(trained, tmp_path / "theirs", encoder="run_gadget:small")
    loaded = load_run(run, trust_code=True)
    assert gadget_module.exists()  # the module ran: trusted
    assert f"note: trusting {run / 'checkpoint.pt'}: importing its encoder run_gadget:small (module run_gadget)" \
        in caplog.messages
    torch.testing.assert_close(loaded.learner.state_dict(), load_run(trained).learner.state_dict())


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_data_folder_inside_the_run_is_not_read(trained, tmp_path, monkeypatch, capsys, where):
    """A CIFAR run whose data folder is its own run folder's (a gadget in batches.meta): no reader unpickles it."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "theirs" / "data"
    data_dir = "theirs/data" if where == "relative" else str(data)
    run = _forged(trained, tmp_path / "theirs", dataset="cifar10", data_dir=data_dir)
    (data / "cifar-10-batches-py").mkdir(parents=True)
    (data / "cifar-10-batches-py" / "batches.meta").write_bytes(pickle.dumps(_Gadget()))
    why = "is relative" if where == "relative" else "is the run folder or lies in it"
    for main in (report_script.main, inspect_gates.main):
        assert main([str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith(f"note: {run / 'checkpoint.pt'} names the data folder {data_dir!r}, which {why}; ")
        assert _one_error_line(err[1]).startswith("error: dataset 'cifar10' needs a data directory (--data-dir)")
    assert not (tmp_path / "marker").exists()
    # named by the user: read, through the restricted unpickler
    assert report_script.main([str(run), "--data-dir", str(data)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (f"error: {data / 'cifar-10-batches-py' / 'batches.meta'} is not a CIFAR batch (it names "
                    "posix.system, which no CIFAR file holds); re-extract the official python-version archive")
    assert not (tmp_path / "marker").exists()


def test_cifar_batches_are_read_with_a_restricted_unpickler(tmp_path, monkeypatch):
    folder = write_cifar_pickles(tmp_path / "good", "cifar10")
    assert len(load_dataset("cifar10", folder).train) == 20  # the arrays and lists CIFAR holds still load
    monkeypatch.chdir(tmp_path)
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": _Gadget(), b"labels": [0]}))
    with pytest.raises(UserError, match=r"data_batch_2 is not a CIFAR batch \(it names posix.system, which no CIFAR "
                       r"file holds\); re-extract"):
        load_dataset("cifar10", folder)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("change, message", [
    (lambda meta, batch: meta.pop(b"label_names"), "batches.meta holds no 'label_names'"),
    (lambda meta, batch: meta.update({b"label_names": [b"a"]}), "batches.meta: its label_names is not a list of 10 "
                                                                "class names"),
    (lambda meta, batch: batch.pop(b"labels"), "data_batch_2 holds no 'labels'"),
    (lambda meta, batch: batch.update({b"data": batch[b"data"][:, :100]}), "data_batch_2: its data is uint8 of shape "
                                                                           "(4, 100), not rows of 3072 bytes"),
    (lambda meta, batch: batch.update({b"labels": [0, 1, 2, 12]}), "data_batch_2: its labels are not 4 class numbers "
                                                                   "in [0, 10), one per image"),
])
def test_cifar_pickles_that_are_not_cifar_are_one_line_before_training(tmp_path, change, message):
    """Missing keys, short rows, labels out of range (which failed at the evaluation, after the whole training)."""
    folder = write_cifar_pickles(tmp_path, "cifar10")
    meta, batch = (pickle.loads((folder / name).read_bytes()) for name in ("batches.meta", "data_batch_2"))
    change(meta, batch)
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    (folder / "data_batch_2").write_bytes(pickle.dumps(batch))
    with pytest.raises(UserError, match=re.escape(message) + ".*; re-extract the official python-version archive$"):
        load_dataset("cifar10", folder)


def test_cifar_class_names_may_be_text(tmp_path):
    folder = write_cifar_pickles(tmp_path, "cifar10")
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}" for i in range(10)]}))
    assert load_dataset("cifar10", folder).classes[:2] == ["c0", "c1"]


def test_a_run_records_its_data_folder_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve(Config(dataset="imagefolder", data_dir="photos", out="runs/x"))
    assert cfg.data_dir == str(tmp_path / "photos")


# ------------------------------------------------------------------------------- the output folder is ours


def _mount_tmpfs(folder: Path, size: str):
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()[:200]}")


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_leaves_no_temporary_file(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "9m")
    try:
        trainer = Trainer(fast(disk / "run", ckpt_every=2), progress=False)
        trainer.train(2)
        good = (disk / "run" / "checkpoint.pt").read_bytes()
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (free - len(good) // 2))  # room for half a checkpoint
        with pytest.raises(UserError) as err:
            trainer.train(4)
        assert str(err.value) == (f"cannot write {disk / 'run' / 'checkpoint.pt'}: No space left on device; free "
                                  "some space or choose another --out (any previous checkpoint.pt is unchanged)")
        assert (disk / "run" / "checkpoint.pt").read_bytes() == good
        assert not list((disk / "run").glob("*.tmp"))
        filler.unlink()
        del trainer, err
        resumed = Trainer(fast(disk / "run", ckpt_every=2), progress=False)  # the rerun: config.json fits again
        assert resumed.step == 2
        del resumed
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_second_run_on_one_folder_is_refused_naming_the_first(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from bayesncl_pyro import rundir; "
         f"Path({str(out)!r}).mkdir(); lock = rundir.lock(Path({str(out)!r})); print('locked', flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert run_svi.main([*TINY_RUN, "--out", str(out)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert re.fullmatch(f"error: {re.escape(str(out))} is in use by another run \\(process {holder.pid} on .+\\); "
                            "wait for it to end, or pass another --out", line), line
        assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # nothing written
    finally:
        holder.communicate("")
    trainer = Trainer(fast(out), progress=False)  # the first has ended: its lock with it
    assert (out / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}\n"
    del trainer


def test_a_run_killed_while_writing_its_config_blocks_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    # what a SIGKILL in the middle of the first write of config.json leaves: the run had claimed the folder, with its
    # marker and its lock (a folder of such names without our marker is a user's: test_run_folder_second_layer.py)
    (tmp_path / "run" / "bayesncl-pyro.run").write_text("bayesncl-pyro run folder\n")
    (tmp_path / "run" / "run.lock").write_text("process 4321 on elsewhere\n")
    (tmp_path / "run" / "config.json.4321.tmp").write_text('{"data')
    trainer = Trainer(fast(tmp_path / "run"), progress=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["bayesncl-pyro.run", "config.json", "run.lock"]
    del trainer


def test_temporary_files_are_named_by_their_process(tmp_path, monkeypatch):
    written = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: (written.extend(os.listdir(tmp_path)), real(obj, f)))
    rundir.atomic_save({"w": torch.zeros(2)}, tmp_path / "checkpoint.pt")
    assert written == [f"checkpoint.pt.{os.getpid()}.tmp"] and os.listdir(tmp_path) == ["checkpoint.pt"]


def _users_folder(folder: Path) -> dict:
    """A folder of the user's own files, some named as a run's are; returns their contents."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"eval.json": '{"mine": 1}\n', "log.jsonl": '{"step": 99}\n', "gates.nc": "not ours", "notes.txt": "hi"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def _unchanged(folder: Path, files: dict) -> bool:
    return {p.name: p.read_text() for p in folder.iterdir()} == files


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_that_is_not_a_run_is_refused_with_and_without_overwrite(tmp_path, capsys, overwrite):
    files = _users_folder(tmp_path / "mine")
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "mine"), *overwrite]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {tmp_path / 'mine'} holds files that are not a bayesncl-pyro run (eval.json, gates.nc, log.jsonl, "
        "notes.txt); pass a new or empty --out (--overwrite moves only an earlier run's files aside)")
    assert _unchanged(tmp_path / "mine", files)


@pytest.mark.parametrize("out, what", [(".", "the working folder"), ("..", "a folder above the working folder"),
                                       ("data", "the data folder"), ("data/..", "the working folder"),
                                       ("data/val", "inside the data folder"),
                                       ("data/train/new", "inside the data folder")])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_may_not_be_the_working_or_data_folder_or_above_them(tmp_path, monkeypatch, capsys, out, what,
                                                                 overwrite):
    repo = tmp_path / "repo"
    files = _users_folder(repo)
    make_tree(repo / "data", {"train": ["a"], "val": ["a"]})
    files["data"] = None
    monkeypatch.chdir(repo)
    argv = ["--dataset", "imagefolder", "--data-dir", "data", "--encoder", "cnn", "--image-size", "8", *overwrite]
    assert run_svi.main([*argv, "--out", out]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: --out {out} is {what}") and line.endswith(
        "; a run needs a folder of its own: pass e.g. --out runs/NAME")
    assert sorted(p.name for p in repo.iterdir()) == sorted(files)  # nothing moved aside, nothing written


def test_a_run_that_wrote_no_checkpoint_blocks_nothing(tmp_path, caplog):
    """A run that diverged (or was refused) before its first checkpoint left config.json: the corrected command
    runs, and the earlier files are moved aside."""
    Trainer(fast(tmp_path / "run"), progress=False)  # set up, never saved
    (tmp_path / "run" / "log.jsonl").write_text('{"step": 1, "loss": NaN}\n')
    Trainer(fast(tmp_path / "run", lr=0.01), progress=False)
    assert any("holds a run with a different configuration (lr: 0.1 -> 0.01) that wrote no checkpoint" in m
               for m in caplog.messages)
    aside = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["config.json", "log.jsonl"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == 0.01


@pytest.mark.parametrize("flags, message", [
    (["--dataset", "in100", "--data-dir", "no-such-folder"], "no-such-folder"),
    ([*TINY_RUN, "--batch-size", "100000"], "is larger than the training set"),
])
def test_a_refused_run_leaves_no_claimed_folder(tmp_path, monkeypatch, capsys, flags, message):
    """a run refused while it set up left its marker and run.lock in a folder of its own, which the
    corrected command then met; a folder that held a run before keeps it."""
    monkeypatch.chdir(tmp_path)
    assert run_svi.main([*flags, "--out", "runs/new"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs" / "new").exists()
    earlier = tmp_path / "runs" / "earlier"
    assert run_svi.main([*TINY_RUN, "--method", "ncl", "--out", str(earlier), "--max-steps", "1"]) == 0
    files = sorted(p.name for p in earlier.iterdir() if p.name not in ("bayesncl-pyro.run", "run.lock"))
    assert run_svi.main([*flags, "--out", str(earlier), "--overwrite"]) == 2
    (aside,) = [p for p in earlier.iterdir() if p.name.startswith("previous-")]
    assert sorted(p.name for p in aside.iterdir()) == files  # nothing of the earlier run lost
    assert sorted(p.name for p in earlier.iterdir() if p != aside) == ["bayesncl-pyro.run", "run.lock"]


# -------------------------------------------------------------------------------------- the report's JSON


HOSTILE = ["<!--<script>", "</script><b>&amp;x", "a & b > c"]


class _Scripts(HTMLParser):
    def __init__(self):
        super().__init__()
        self.inside, self.texts = None, {}

    def handle_starttag(self, tag, attrs):
        self.inside = dict(attrs).get("id") if tag == "script" else None

    def handle_data(self, data):
        if self.inside:
            self.texts[self.inside] = self.texts.get(self.inside, "") + data


def test_inline_json_holds_no_markup_characters():
    data = {"classes": HOSTILE, "run": {"dir": "runs/<!--", "method": "ncl", "dataset": "x"}}
    page = report.focused(report.render(data, ["data:,"]), "dim/1")
    scripts = _Scripts()
    scripts.feed(page)
    assert json.loads(scripts.texts["data"]) == data and json.loads(scripts.texts["focus"]) == "dim/1"
    for text in scripts.texts.values():
        assert not set(text) & set("<>&"), text


def test_a_report_with_hostile_class_names_opens_in_chromium(tab, tmp_path):
    from bayesncl_pyro.cli import bench_report

    feats = bench_report.stand_in(60, 8, 3)
    kl = torch.full((8,), 0.1)
    run = dict(dir="runs/<!--<script>", method="bayesncl", dataset="x", config=dict(kl_weight=3e-5, gate="ste"))
    data = report_data.report_data(feats, run, gates=report_data.gate_summary(feats, kl, "KL", 0.8), kl=kl)
    data["classes"] = HOSTILE
    page = report.write(data, report_data.thumbnails(bench_report.stand_in_images(60)), tmp_path)
    tab.open(page, "#dims")
    assert tab.dims() and HOSTILE[0] in tab.page.inner_text("#view-dims .cls")
    assert tab.errors == []


# ---------------------------------------------------------------------------- the last bad inputs: one line


@pytest.mark.parametrize("flags, message", [
    (["--momentum", "-1"], "--momentum must lie in [0, 1), got -1.0"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 2147483647, got -1"),
    (["--lr", "inf"], "--lr must be a finite number of at most 3.403e+38 (float32), got inf"),
    (["--kl-weight", "inf"], "--kl-weight must be a finite number of at most 3.403e+38 (float32), got inf"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number of at most 3.403e+38 (float32), got nan"),
    (["--momentum", "nan"], "--momentum must be a finite number of at most 3.403e+38 (float32), got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number of at most 3.403e+38 (float32), got nan"),
    (["--weight-decay", "1e308"], "--weight-decay must be a finite number of at most 3.403e+38 (float32), got 1e+308"),
    *[([flag, "1" + "0" * 30], f"{flag} must be at most 9223372036854775807 (what a run's files store), got "
                                f"1{'0' * 30}")
      for flag in ("--epochs", "--max-steps", "--conflict-every", "--monitor-every")],
    (["--device", "cuda:99999999999999999999"], "--device cuda:99999999999999999999: no GPU has that number (torch "
                                                "numbers them 0 to 127); pass cuda or cuda:N for one of this machine's "
                                                "GPUs"),
])
def test_bad_numbers_are_one_line(tmp_path, capsys, flags, message):
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "run"), *flags]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"error: {message}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", b"epochs: 3  # caf\xe9\n", "is not UTF-8 text (byte 16); save it as UTF-8"),
    ("c.yaml", b"epochs: 3\nseed: 1\nepochs: 4\n", "is not readable YAML (epochs given twice: keep one)"),
    ("c.json", b'{"epochs": 3, "epochs": 4}', "is not readable JSON (epochs given twice: keep one)"),
])
def test_bad_config_files_are_one_line(tmp_path, name, text, message):
    (tmp_path / name).write_bytes(text)
    with pytest.raises(UserError, match=re.escape(f"--config {tmp_path / name} {message}")):
        read_config_file(tmp_path / name)


_BOMB = "".join(f"  - &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))  # 9^9 lols


@pytest.mark.parametrize("name, text, message", [
    ("bomb.yaml", 'epochs:\n  - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + _BOMB,
     "holds more than 1,000,000 values (a YAML alias nested in aliases repeats its values)"),
    ("args.yaml", 'method: bayesncl\nprior: beta-bernoulli\nprior_args:\n  concentration:\n'
     '  - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + _BOMB,
     "holds more than 1,000,000 values"),  # its repr was built for --prior-arg's message: 2.5 GB and counting
    ("value.json", json.dumps({"nonneg": "x" * 10**7}), "holds a string of 10,000,000 characters ('xxx"),
    ("twice.json", "{" + ", ".join(f'"key{i}": 1, "key{i}": 2' for i in range(30_000)) + "}",
     "(key0, key1, key10, key100 and 29996 more given twice: keep one)"),
    ("keys.json", json.dumps({f"key{i}": i for i in range(60_000)}), "unknown key 'key0'"),  # took 39 s: quadratic
    ("deep.json", "[" * 100_000 + "]" * 100_000, "is not readable JSON (nested too deep)"),
])
def test_a_huge_config_is_one_short_line(tmp_path, capsys, name, text, message):
    """A YAML alias bomb under a key or in prior_args (whose repr filled the memory), a 10 MB value (a 10 MB error
    line), 60,000 keys, a file nested 100,000 deep: each refused in a line that quotes at most 80 characters."""
    (tmp_path / name).write_text(text)
    assert run_svi.main(["--config", str(tmp_path / name), "--out", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: --config {tmp_path / name}") and message in line and len(line) < 300, line[:300]


def test_a_run_folders_config_nested_too_deep_is_one_line(tmp_path, capsys):
    Trainer(fast(tmp_path / "run"), progress=False)
    (tmp_path / "run" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "run")]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {tmp_path / 'run' / 'config.json'} is not readable JSON (nested too deep); pass --overwrite to move "
        "the folder's files aside and start afresh, or pass another --out")


@pytest.mark.parametrize("flag, value", [("--proj-dim", "100000000"), ("--proj-dim", "10000000000"),
                                         ("--proj-hidden", "2000000000"), ("--head-depth", "1000000000")])
def test_a_head_larger_than_the_memory_is_one_line_before_anything_is_built(tmp_path, capsys, monkeypatch, flag,
                                                                           value):
    """Allocation tracebacks, or (--head-depth) layers allocated one at a time until the kernel killed the run; and
    refused before the prior is built: one of K = 10^10 values would need 40 GB."""
    from bayesncl_pyro.infer import checks  # where the head's prior is built and checked

    monkeypatch.setattr(checks, "build_prior", lambda *args, **kw: pytest.fail("the prior was built"))
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "run"), flag, value]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.fullmatch(r"error: the head's weights alone \(--proj-hidden=\d+, --proj-dim=\d+, --head-depth=\d+\) "
                        r"would need [\d.e+]+ GiB, more than this machine's [\d.]+ GiB of memory; lower one of them",
                        line), line
    assert f"{flag}={value}" in line


def test_a_finished_run_rerun_with_a_larger_max_steps_trains_on(tmp_path):
    """It said "resuming at step 2 of 4" and trained nothing; now it trains to 4, and its evaluation of step 2 is not
    taken for this one's (run_svi.py evaluates and exports the gates again)."""
    first = Trainer(fast(tmp_path / "run", max_steps=2), progress=False).fit()
    rundir.write_json({"of": "step 2"}, tmp_path / "run" / "eval.json")  # as its evaluation wrote it
    assert (first.finished, first.step) == (True, 2)
    del first
    trainer = Trainer(fast(tmp_path / "run", max_steps=4), progress=False)
    assert (trainer.finished, trainer.evaluated, trainer.step, trainer.last_step) == (False, False, 2, 4)
    trainer.fit()
    assert [r["step"] for r in rundir.read_log(tmp_path / "run")] == [1, 2, 3, 4]
    assert rundir.load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 4


def test_yaml_may_override_a_merged_key(tmp_path):
    (tmp_path / "c.yaml").write_text("prior_args: {<<: {concentration: 1}, concentration: 5}\n")
    assert read_config_file(tmp_path / "c.yaml") == {"prior_args": {"concentration": 5}}


def test_an_image_size_out_of_memory_is_named_as_such():
    with pytest.raises(UserError, match=r"^--image-size 1000000: two blank 3-channel 1000000 px images through "
                       r"--encoder cnn ran out of memory \(RuntimeError: .*\); lower --image-size$"):
        build_backbone("cnn", 3, 10**6)


def test_an_unreadable_checkpoint_gives_no_advice_to_run_its_code(tmp_path):
    torch.save({"config": _Gadget()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UserError) as err:
        rundir.load_checkpoint(tmp_path / "checkpoint.pt")
    assert str(err.value) == (f"cannot read checkpoint {tmp_path / 'checkpoint.pt'}: it holds objects other than "
                              "tensors and plain values (Trying to load unsupported GLOBAL posix.system whose module "
                              "posix is blocked); it is corrupt or not a bayesncl-pyro checkpoint (move it away to "
                              "start afresh)")


def test_names_that_are_not_utf8_or_hold_a_dollar_train_export_and_plot(tmp_path, capsys):
    """A class folder whose name is not UTF-8, one named with '$' (matplotlib's mathtext), and a bad image whose name
    is not UTF-8 with --skip-bad-images: the run trains, lists the bad file, exports gates.nc, and inspect_gates
    draws its figures and exports again."""
    data = os.fsencode(tmp_path / "data")
    classes = [b"caf\xe9", b"cost $^$"]
    for split in (b"train", b"val"):
        for c in classes:
            os.makedirs(os.path.join(data, split, c))
            for i in range(6):
                write_image(Path(os.fsdecode(os.path.join(data, split, c, b"%d.png" % i))))
    bad = os.path.join(data, b"train", classes[0], b"bad\xff.png")
    with open(bad, "wb") as f:
        f.write(b"junk")
    out = tmp_path / "run"
    argv = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--encoder", "cnn", "--image-size",
            "8", "--proj-hidden", "16", "--proj-dim", "8", "--batch-size", "8", "--epochs", "2", "--warmup-epochs",
            "0", "--workers", "0", "--skip-bad-images", "--monitor-every", "0", "--out", str(out)]
    assert run_svi.main(argv) == 0, capsys.readouterr().err
    assert "warning: 1 unreadable images were skipped" in capsys.readouterr().err
    assert (out / "bad_images.txt").read_bytes() == bad + b"\n" and (out / "gates.nc").exists()
    assert inspect_gates.main([str(out), "--export"]) == 0, capsys.readouterr().err
    assert (out / "inspect" / "class_heatmap.png").exists()
    from bayesncl_pyro.evaluate.arviz_export import read_gates

    assert list(read_gates(out)["gates"]["class"].values) == ["caf\\xe9", "cost $^$"]


def test_the_lock_goes_with_its_process_not_with_the_workers_it_forked(tmp_path):
    """A loader worker (a forked child) left behind by a SIGKILL'd run must not keep the next run out."""
    import multiprocessing

    out = tmp_path / "run"
    out.mkdir()
    held = rundir.lock(out)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        del held  # the run's process lets go (as by dying); its worker lives on
        other = subprocess.run([sys.executable, "-c", "from pathlib import Path; from bayesncl_pyro import rundir; "
                                f"rundir.lock(Path({str(out)!r}))"], capture_output=True, text=True)
        assert other.returncode == 0, other.stderr
    finally:
        child.kill()
        child.join()
