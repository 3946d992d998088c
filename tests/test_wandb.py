"""--wandb, offline (WANDB_MODE=offline: no network): the run's W&B records hold what TensorBoard gets, every numeric
log field, the per-dimension inclusion histogram and eval.json, plus the config; a resumed run logs into the same W&B
run."""

import json
import struct
import sys

import pytest

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.loggers import INCLUSION
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.train.trainer import Trainer

TINY = dict(dataset="digits", proj_hidden=32, proj_dim=16, batch_size=200, epochs=2, warmup_epochs=0, workers=0,
            log_every=3, monitor_every=1, wandb=True)


def records(path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): the LevelDB log format, 32 KiB blocks of
    chunks, each with a 7-byte header (CRC, length, kind: 1 whole, 2 first, 3 middle, 4 last), after a 7-byte file
    header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the block's zero padding
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def history(run_dir):
    """{step: {key: value}} logged to the run's W&B runs (all of them: one per process that trained), and its config."""
    rows, config = {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.setdefault(items["_step"], {}).update(items)
            elif kind == "run":
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return rows, config


def test_wandb_offline_holds_the_log_the_histogram_the_evaluation_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    first = Trainer(Config(out=str(out), **TINY), progress=False)
    first.train(5)  # then stopped, as by Ctrl-C: the checkpoint saved, the W&B run closed
    first.save()
    first.log.close()
    Trainer(Config(out=str(out), **TINY), progress=False).fit().evaluate()  # resumed: the same W&B run goes on
    rows, config = history(out)
    assert len({p.name for p in (out / "wandb").glob("offline-run-*")}) == 2
    # one run id, read from each folder's run-<id>.wandb: a folder's name ends in "-1" when both started in the same
    # second
    assert len({p.stem.removeprefix("run-") for p in (out / "wandb").glob("offline-run-*/run-*.wandb")}) == 1
    log = read_log(out)
    assert any("knn_top1" in r for r in log)  # the monitoring records go along
    for r in log:
        for key, value in r.items():
            if key != "step" and type(value) in (int, float):
                assert rows[r["step"]][f"train/{key}"] == pytest.approx(value, rel=1e-6), (r["step"], key)
        histogram = {k.removeprefix(INCLUSION + "/"): v for k, v in rows[r["step"]].items()
                     if k.startswith(INCLUSION + "/")}  # W&B writes its fields as nested keys
        assert histogram["_type"] == "histogram" and sum(histogram["values"]) == 16  # the K dims' mean inclusion
    results = json.loads((out / "eval.json").read_text())
    numeric = {k: v for k, v in results.items() if type(v) in (int, float)}
    assert {"linear_probe_top1", "semantic_consistency", "active_dims"} <= numeric.keys()
    last = rows[log[-1]["step"]]
    for key, value in numeric.items():
        assert last[f"eval/{key}"] == pytest.approx(value, rel=1e-6), key
    assert config["seed"] == 0 and config["proj_dim"] == 16 and config["dataset"] == "digits"


def test_wandb_missing_is_one_line_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # its import fails, as without the package
    with pytest.raises(UserError, match=r"--wandb needs the wandb package: pip install -e '\.\[wandb\]'"):
        Trainer(Config(out=str(tmp_path / "run"), **TINY), progress=False)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


class StandIn:
    """wandb, as far as a run calls it, offline; ``init`` checks its arguments as wandb does (its own ``Settings``:
    ``resume`` and ``resume_from`` exclude each other, ``resume_from`` is ``ID?_step=N`` of the same id) and records
    them. ``refuse``: a server without the rewind preview."""

    def __init__(self, settings, refuse: bool = False):
        self.settings, self.calls, self.refuse = settings, [], refuse

    def init(self, **kwargs):
        self.settings(run_id=kwargs["id"], resume=kwargs.get("resume"), resume_from=kwargs.get("resume_from"))
        self.calls.append(kwargs)
        if self.refuse and "resume_from" in kwargs:
            raise RuntimeError("rewinding runs is not enabled for this entity")

        class Run:
            summary = {}

            def log(self, values, step):
                pass

            def finish(self):
                pass

        return Run()

    def teardown(self):
        pass

    @staticmethod
    def Histogram(values):  # noqa: N802 (wandb's name)
        return list(values)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_run_killed_past_its_checkpoint_rewinds_its_wandb_run(tmp_path, monkeypatch, caplog, refuse):
    """A resumed run logged into the same W&B run with resume="allow" whether or not it had logged past its
    checkpoint: W&B kept the killed run's records of the steps taken again and dropped the resumed run's."""
    real = pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    wandb = StandIn(real.Settings, refuse)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    out = tmp_path / "run"
    first = Trainer(Config(out=str(out), **TINY), progress=False)
    first.train(5)
    first.save()  # stopped at its checkpoint: nothing past it
    first.log.close()
    second = Trainer(Config(out=str(out), **TINY), progress=False)
    run_id = (out / "wandb" / "run_id").read_text().strip()
    assert [call.get("resume") for call in wandb.calls] == ["allow", "allow"]
    assert not any("resume_from" in call for call in wandb.calls)
    second.train(7)  # logs past step 5, then killed: no checkpoint past it
    second.log.close()
    assert read_log(out)[-1]["step"] > 5
    Trainer(Config(out=str(out), **TINY), progress=False)
    assert read_log(out)[-1]["step"] <= 5  # log.jsonl cut back to the checkpoint's step
    assert wandb.calls[2]["id"] == run_id and wandb.calls[2].get("resume_from") == f"{run_id}?_step=6"
    assert "resume" not in wandb.calls[2]
    if refuse:  # then resumed as before, with a note saying what W&B keeps
        assert wandb.calls[3].get("resume") == "allow" and len(wandb.calls) == 4
        assert f"W&B did not rewind run {run_id} to step 6 (rewinding runs is not enabled" in caplog.text
    else:
        assert len(wandb.calls) == 3
