"""--tensorboard: the log, the per-dimension inclusion histogram and the evaluation, read back as events."""

import json
import sys

import pytest

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.loggers import INCLUSION
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.train.trainer import Trainer

TINY = dict(dataset="digits", proj_hidden=32, proj_dim=16, batch_size=200, epochs=1, warmup_epochs=0, workers=0,
            log_every=2, tensorboard=True)


def test_events_hold_every_logged_scalar_the_inclusion_histogram_and_the_evaluation(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is an optional extra: pip install -e '.[tensorboard]'")
    out = tmp_path / "run"
    Trainer(Config(out=str(out), **TINY), progress=False).fit().evaluate()
    events = event_accumulator.EventAccumulator(str(out), size_guidance={event_accumulator.HISTOGRAMS: 0})  # 0: all
    events.Reload()
    log = read_log(out)
    assert [r["step"] for r in log] == [2, 4, 6, 7]
    logged = {k for r in log for k, v in r.items() if k != "step" and type(v) in (int, float)}
    assert {"loss", "nce", "kl", "gate_rate", "incl_min", "gate_nce_pull", "images_per_s"} <= logged
    for key in logged:
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [r["step"] for r in log if key in r], key  # num_threads: the first
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in log if key in r], rel=1e-6), key
    histograms = events.Histograms(INCLUSION)
    assert [h.step for h in histograms] == [2, 4, 6, 7]
    last = histograms[-1].histogram_value
    assert last.num == 16 and 0 < last.min <= last.max < 1  # the K dimensions' mean inclusion probabilities
    results = json.loads((out / "eval.json").read_text())
    numeric = {k: v for k, v in results.items() if type(v) in (int, float)}
    assert {"linear_probe_top1", "semantic_consistency", "active_dims"} <= numeric.keys()
    for key, value in numeric.items():
        (scalar,) = events.Scalars(f"eval/{key}")
        assert scalar.step == 7 and scalar.value == pytest.approx(value, rel=1e-6), key
    assert not {t for t in events.Tags()["scalars"] if t.split("/")[0] not in ("train", "eval")}


def test_tensorboard_missing_is_one_line_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as without the package
    with pytest.raises(UserError, match=r"--tensorboard needs the tensorboard package: pip install -e '\.\[tensorb"):
        Trainer(Config(out=str(tmp_path / "run"), **TINY), progress=False)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_resumed_run_hides_the_events_a_killed_run_logged_past_its_checkpoint(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is an optional extra: pip install -e '.[tensorboard]'")
    out = tmp_path / "run"
    cfg = Config(out=str(out), **{**TINY, "log_every": 1, "ckpt_every": 2, "max_steps": 6})
    killed = Trainer(cfg, progress=False)
    killed.train(5)  # a checkpoint at step 4; step 5 logged, then killed
    killed.log.close()
    del killed
    Trainer(cfg, progress=False).fit()
    events = event_accumulator.EventAccumulator(str(out))
    events.Reload()
    assert [s.step for s in events.Scalars("train/loss")] == [r["step"] for r in read_log(out)] == [1, 2, 3, 4, 5, 6]
