"""The dataset recipes and the evaluation protocol they choose."""

import pytest

from bayesncl_pyro.config import DATASET_DEFAULTS, Config, resolve
from bayesncl_pyro.errors import UserError


def test_every_dataset_has_its_own_recipe(monkeypatch):
    assert len({id(d) for d in DATASET_DEFAULTS.values()}) == len(DATASET_DEFAULTS)
    assert DATASET_DEFAULTS["cifar100"] == DATASET_DEFAULTS["cifar10"]  # the same reference recipe, as a copy
    monkeypatch.setitem(DATASET_DEFAULTS["cifar100"], "epochs", 1)
    assert DATASET_DEFAULTS["cifar10"]["epochs"] == 200
    assert resolve(Config(dataset="cifar10")).epochs == 200


@pytest.mark.parametrize("dataset, protocol", [("cifar10", "reference"), ("cifar100", "reference"),
                                               ("in100", "reference"), ("digits", "fast"),
                                               ("compositional", "fast"), ("imagefolder", "fast")])
def test_the_recipe_chooses_the_evaluation_protocol(dataset, protocol):
    assert resolve(Config(dataset=dataset)).eval_protocol == protocol
    assert resolve(Config(dataset=dataset, eval_protocol="fast")).eval_protocol == "fast"


def test_the_reference_protocol_is_refused_where_the_paper_has_none():
    with pytest.raises(UserError, match="paper's protocol for cifar10, cifar100, in100.*--eval-protocol fast"):
        resolve(Config(dataset="digits", eval_protocol="reference"))
    with pytest.raises(UserError, match="unknown --eval-protocol 'paper'; choose one of: fast, reference"):
        resolve(Config(dataset="cifar10", eval_protocol="paper"))
