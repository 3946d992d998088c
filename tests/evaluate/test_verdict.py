"""The default run's closing sentence: this run's figures beside the shipped ten-seed result, the same words whatever
this run's noise."""

import copy
import fnmatch
import json
import re
import tomllib

from helpers import ROOT

from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.config import Config, with_recipe
from bayesncl_pyro.evaluate import verdict

RECORDS = ROOT / verdict.RECORDS


def _eval(seed: int) -> dict:
    return json.loads((RECORDS / f"bayesncl-ste-seed{seed}" / "eval.json").read_text())


def _words(text: str) -> str:
    return re.sub(r"[-+]?\d+(\.\d+)?", "#", text)


def test_the_shipped_summary_agrees_with_the_records_and_is_package_data():
    assert verdict.shipped() == verdict.summarise(RECORDS)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(verdict.SUMMARY.name, p) for p in patterns["bayesncl_pyro.evaluate"])
    assert verdict.SUMMARY.parent == ROOT / "bayesncl_pyro" / "evaluate"  # inside the package, not docs/


def test_the_closing_sentence_quotes_the_ten_seed_interval_and_reads_the_same_under_noise():
    """Seed 0 with one thread (the record) and with two (the README's figures): on main the first closed with the gates
    "above" post-hoc TopK and the second "level with" it."""
    cfg = with_recipe(Config())
    one_thread = _eval(0)
    two_threads = copy.deepcopy(one_thread)
    two_threads.update(semantic_consistency=0.234, semantic_consistency_ungated=0.170,
                       semantic_consistency_topn=0.404, semantic_consistency_topn_ungated=0.401)
    two_threads["controls"]["posthoc_topk"].update(semantic_consistency=0.278, semantic_consistency_topn=0.412)
    summary = verdict.shipped()
    d = summary["gates_minus_posthoc_topn"]
    assert d["low"] < 0 < d["high"]  # the records' verdict: not separated from post-hoc TopK, said as a bound
    closing = [run_svi.outcome(e, cfg).splitlines()[-1] for e in (one_thread, two_threads, _eval(9), _eval(4))]
    assert len({_words(c) for c in closing}) == 1, closing
    assert f"[95 % interval {d['low']:+.3f}, {d['high']:+.3f}]" in closing[0]
    assert ("do not separate the gates' choice of entries from keeping each image's largest ones (a gain above "
            f"{d['high']:+.3f} or a loss below {d['low']:+.3f} is ruled out at 95 %)") in closing[0]
    assert "level with" not in closing[0]  # an interval holding zero is no equivalence
    assert "+0.011" in closing[0] and "-0.008" in closing[1]  # this run's own digits stand beside it


def test_another_recipe_is_not_told_the_ten_seed_result_is_its_own():
    cfg = with_recipe(Config(dataset="compositional", gate="leg"))
    sentence = verdict.closing_sentence(_eval(0), cfg)
    assert "this recipe" not in sentence and "not this run's" in sentence and "compare.py --seeds" in sentence
    assert verdict.same_recipe(with_recipe(Config(seed=7)), verdict.shipped())
