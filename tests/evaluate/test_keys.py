"""eval.json's keys: one codec of (metric, representation) that reads and writes the recorded names."""

import itertools
import json

import pytest
from helpers import ROOT

from bayesncl_pyro.evaluate import keys
from bayesncl_pyro.evaluate.matched import DEFINITIONS
from bayesncl_pyro.evaluate.pairing import MATCH_ON, METRICS, READINGS, TOPK_KEYS

RECORDS = ROOT / "docs" / "results" / "verdict-comp"


def test_the_recorded_names_parse_to_metric_and_representation():
    assert keys.parse("semantic_consistency") == ("semantic_consistency", keys.F)
    assert keys.parse("semantic_consistency_topn_q_draws") == ("semantic_consistency_topn", keys.Q_DRAWS)
    assert keys.parse("dims_tracking_class_random_mask") == ("dims_tracking_class", keys.RANDOM_MASK)
    assert keys.parse("activation_rate_posterior_mean") == ("activation_rate", keys.POSTERIOR_MEAN)
    assert keys.parse("ungated_dims_tracking_class") == ("dims_tracking_class", keys.UNGATED)  # recorded as a prefix
    assert keys.parse("gated_off_dims_class") == ("gated_off_dims_class", keys.F)
    assert keys.format("dims_tracking_background", keys.UNGATED) == "ungated_dims_tracking_background"
    assert keys.format("dims_tracking_background", keys.Q_DRAWS) == "dims_tracking_background_q_draws"
    with pytest.raises(ValueError, match="unknown representation"):
        keys.format("semantic_consistency", "_ungated")


def test_every_key_of_a_recorded_evaluation_round_trips_and_its_representations_are_todays():
    record = json.loads((RECORDS / "bayesncl-ste-seed0" / "eval.json").read_text())
    figures = [k for k, v in record.items() if not isinstance(v, (dict, str))]
    parsed = [keys.parse(k) for k in figures]
    assert [keys.format(*p) for p in parsed] == figures
    found = {r for _, r in parsed}
    assert found == set(keys.REPRESENTATIONS)
    # each other representation has the figures F has that change with it, under the same metric names
    for r in found - {keys.F}:
        assert {m for m, s in parsed if s == r} <= {m for m, s in parsed if s == keys.F}, r
    assert record["representations"] == {keys.suffix(r) or "(no suffix)": DEFINITIONS[r] for r in keys.REPRESENTATIONS}


def test_trained_topks_keys_are_the_recorded_ones():
    comparison = json.loads((RECORDS / "comparison-d0.3.json").read_text())
    run = next(r for r in comparison["runs"] if r["family"].startswith("bayesncl"))
    recorded = {k for k in run if k.startswith("topk_")}
    made = {keys.topk(metric, measure, alone, reading)
            for metric, measure, alone in itertools.product(TOPK_KEYS, MATCH_ON, (False, True))
            for reading in ("", *(READINGS if metric in METRICS else ()))}
    assert recorded and recorded <= made
    assert keys.topk("semantic_consistency_topn", "sparsity", True, "pchip") in recorded
