"""The run-folder rule (bayesncl_pyro/rundir.py), its second layer: what lay just past the first (issue 52). Hard
links, the names a foreign-file check skipped, every writer (compare.py, a late swap of inspect/) under the rule, the
code a --config from a run folder names, and readers whose memory is bounded. docs/RELIABILITY.md maps each to its
test."""

import gc
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import TINY_COMPARE, TINY_RUN, fast

from bayesncl_pyro.cli import compare, inspect_gates, run_svi
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


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A digits run stopped at step 2 of 4, with a checkpoint: a rerun resumes it."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    trainer = Trainer(fast(out, max_steps=4, conflict_every=1), progress=False)
    trainer.train(2)
    trainer.save()
    del trainer  # its lock goes with it
    gc.collect()
    return out


@pytest.fixture
def unfinished(stopped, tmp_path) -> Path:
    """A copy of the stopped run, for a test to resume."""
    return shutil.copytree(stopped, tmp_path / "run")


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
    assert run_svi.main([*TINY_RUN, "--out", str(mine), *overwrite]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: {mine} holds files that are not a bayesncl-pyro run (checkpoint.pt.2024.tmp, config.json.1.tmp, "
        "previous-drafts); pass a new or empty --out (--overwrite moves only an earlier run's files aside)")
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoint.pt.2024.tmp", "config.json.1.tmp", "previous-drafts"]
    assert (mine / "checkpoint.pt.2024.tmp").read_text() == "mine" and (mine / "config.json.1.tmp").read_text() == \
        "mine too" and (mine / "previous-drafts" / "notes.txt").read_text() == "draft"


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[list[str], Path]:
    """A one-run comparison (NCL, two steps) whose run is kept in a --record folder: a rerun trains nothing."""
    root = tmp_path_factory.mktemp("compared")
    args = [*TINY_COMPARE, "--methods", "ncl", "--device", "cpu", "--out", str(root / "out"), "--record",
            str(root / "record")]
    assert compare.main(args) == 0
    return args, root


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
        f"error: {run / 'inspect'} was replaced while it was written into (it is now a symbolic link, to {elsewhere}); "
        "nothing is written into a folder that is not the one checked: move it away and rerun")
    assert not list(elsewhere.iterdir()) and not list((tmp_path / "moved").iterdir())


@pytest.fixture
def gadget_module(tmp_path, monkeypatch) -> Path:
    """A module ``t52_gadget`` on sys.path that writes ``imported`` when imported; ``small`` builds a small CNN."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "t52_gadget.py").write_text(textwrap.dedent(f'''
        from pathlib import Path
        Path({str(tmp_path / "imported")!r}).touch()
        from bayesncl_pyro.nn.encoders import SmallCNN

        def small(in_channels):
            return SmallCNN(in_channels)
    '''))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "t52_gadget", raising=False)
    return tmp_path / "imported"


@pytest.mark.parametrize("field, spec", [("encoder", "t52_gadget:small"), ("prior", "t52_gadget:Prior")])
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
        "t52_gadget); open it with --trust-run (trust_code=True in Python) only if you trust whoever wrote the run")
    assert not gadget_module.exists() and not (tmp_path / "mine").exists()
    # trusted, or the same file outside a run folder (the user's own), or the code named on the command line: taken
    mine = shutil.copy(run / "config.json", tmp_path / "mine.json")
    for argv in (["--config", str(run / "config.json"), "--trust-run"], ["--config", str(mine)],
                 ["--config", str(run / "config.json"), f"--{field}", spec]):
        assert getattr(run_svi.config(argv)[0], field) == spec
