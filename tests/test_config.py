"""The dataset recipes and the evaluation protocol they choose."""

import pytest

from bayesncl_pyro.config import DATASET_DEFAULTS, Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.train.resolve import resolve


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


def test_a_run_without_out_is_named_by_what_it_is():
    assert resolve(Config()).out == "runs/compositional-bayesncl-ste"
    assert resolve(Config(method="ncl", topk=16)).out == "runs/compositional-ncl-topk=16"
    assert resolve(Config(encoder="resnet50", seed=1)).out == "runs/compositional-bayesncl-ste-encoder=resnet50,seed=1"
    assert resolve(Config(dataset="cifar10", lr=0.4, workers=8)).out == "runs/cifar10-bayesncl-ste"  # the recipe's
    assert resolve(Config(prior="beta-bernoulli", prior_args={"concentration": "5"})).out == (
        "runs/compositional-bayesncl-ste-prior=beta-bernoulli,concentration=5.0")
    many = resolve(Config(gate="relaxed", prior="learned", lr=0.1, kl_weight=1e-4, temperature=0.5)).out
    assert many.startswith("runs/compositional-bayesncl-relaxed-") and len(many) == len(
        "runs/compositional-bayesncl-relaxed-") + 8  # a hash of the settings, when they are many
    assert resolve(Config(out="mine")).out == "mine"


def test_a_config_file_in_json_or_yaml(tmp_path):
    from bayesncl_pyro.rundir import read_config_file

    (tmp_path / "r.yaml").write_text("dataset: digits\nlr: 1\nprior_args: {concentration: 5}\nmax_steps: null\n")
    assert read_config_file(tmp_path / "r.yaml") == dict(dataset="digits", lr=1, prior_args={"concentration": 5},
                                                         max_steps=None)
    (tmp_path / "r.json").write_text('{"epochs": 3}')
    assert read_config_file(tmp_path / "r.json") == {"epochs": 3}


@pytest.mark.parametrize("text, message", [
    ('{"batchsize": 64}', "unknown key 'batchsize'; did you mean 'batch_size'"),
    ('{"epoch": 3}', "unknown key 'epoch'; did you mean 'epochs'"),
    ('{"mixup_alpha": 3}', "unknown key 'mixup_alpha'; the fields are those of bayesncl_pyro.config.Config"),
    ('{"epochs": "3"}', "epochs must be an integer or null, got '3'"),
    ('{"amp": 1}', "amp must be true or false, got 1"),
    ('{"lr": true}', "lr must be a number or null, got True"),
    ('[1, 2]', "holds a list, not a mapping of Config fields"),
    ('{"epochs": 3', "is not readable JSON"),
])
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path, text, message):
    from bayesncl_pyro.rundir import read_config_file

    (tmp_path / "r.json").write_text(text)
    with pytest.raises(UserError, match=message) as err:
        read_config_file(tmp_path / "r.json")
    assert "\n" not in str(err.value)
