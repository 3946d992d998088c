"""The paths that moved and still work, for one release, with a DeprecationWarning naming the new one.

A module that lost a name ends with ``def __getattr__(name): return moved(__name__, name)`` (PEP 562), and
``bayesncl_pyro/posterior.py`` is a module that moved whole. The new home is named by a string and imported on first
use: an old path lies below its new home (``infer/`` gave ``load_learner`` to ``evaluate/``), and an import statement
there would be an upward import. This table is the whole list of such references; CHANGELOG.md says the same, and
both go in 0.5.0. A renamed attribute (or a way of reading one) warns through :func:`renamed`.
"""

import functools
import importlib
import warnings

REMOVED_IN = "0.5.0"

MOVED = {
    # old module -> {name: "new.module:name"}
    "bayesncl_pyro.infer.learner": {"load_learner": "bayesncl_pyro.evaluate.loading:load_learner"},
    # the module was merged into evaluate/dimensions in 0.3.0 without a word; the gate posterior is evaluate/posterior's
    "bayesncl_pyro.posterior": {"gate_posterior": "bayesncl_pyro.evaluate.posterior:gate_posterior",
                                "GatePosterior": "bayesncl_pyro.evaluate.posterior:GatePosterior"},
    # one run's controls stay in evaluate/matched; the pairing across seeds, its table and its figures moved out
    "bayesncl_pyro.evaluate.matched": {
        **{n: f"bayesncl_pyro.evaluate.pairing:{n}" for n in (
            "interpolate", "MECHANISM", "TOPK_KEYS", "MATCH_ON", "topk_at_rate", "METRICS",
            "TOPK_BASELINES", "BASELINES", "default_prior_name", "baseline_value", "paired", "paired_table",
            "MECHANISM_BASELINES", "LABELS", "flat_controls", "family")},
        **{n: f"bayesncl_pyro.evaluate.comparison_figures:{n}" for n in ("plot_paired", "paired_figure",
                                                                          "plot_matched")},
        **{n: f"bayesncl_pyro.evaluate.comparison:{n}" for n in ("MATCHED_COLUMNS", "TOPN_COLUMNS")},
        **{n: f"bayesncl_pyro.evaluate.stats:{n}" for n in ("interval", "holm")},
        "WITHOUT_NCL": "bayesncl_pyro.evaluate.keys:WITHOUT_NCL"},
    # which runs compare.py trains and what their records keep: train/plan, which only cli/ imports
    "bayesncl_pyro.evaluate.comparison": {"plot": "bayesncl_pyro.evaluate.comparison_figures:plot",
                                         "mean_std": "bayesncl_pyro.evaluate.stats:mean_sd",
                                         **{n: f"bayesncl_pyro.train.plan:{n}" for n in (
                                             "METHOD_NAMES", "RECORD", "method_configs", "recorded_run", "record",
                                             "train_time", "shared_settings")}},
    # one KL label: the estimator's, which says what its KL term computes; evaluate/dimensions keeps the numbers per
    # dimension: the gate posterior and the prior's rate moved to evaluate/posterior
    "bayesncl_pyro.evaluate.dimensions": {"kl_label": "bayesncl_pyro.infer.estimators:GateEstimator.kl_label",
                                         **{n: f"bayesncl_pyro.evaluate.posterior:{n}" for n in (
                                             "GatePosterior", "gate_posterior", "prior_rate", "prior_latents",
                                             "learned_parameters")}},
    # evaluate/novelty keeps the declared question across runs; the scores, the control heads and one run's detection
    # moved out
    "bayesncl_pyro.evaluate.novelty": {
        **{n: f"bayesncl_pyro.evaluate.novelty_scores:{n}" for n in (
            "DRAWS", "NEAREST_K", "SCORES", "POSTERIOR_SCORES", "EPISTEMIC_SCORES", "TOPK_SCORES", "binary_entropy",
            "categorical_entropy", "mutual_information", "topk_mask", "topk_margin", "active_set_frequencies",
            "atypicality", "NoveltyScorer")},
        **{n: f"bayesncl_pyro.evaluate.novelty_controls:{n}" for n in (
            "ENSEMBLE", "ControlHeads", "marginal_rate", "fit_control_heads")},
        **{n: f"bayesncl_pyro.evaluate.novelty_detection:{n}" for n in ("detection", "report")}},
    # evaluate/report keeps the page; the numbers it shows (report.json) are evaluate/report_data's
    "bayesncl_pyro.evaluate.report": {n: f"bayesncl_pyro.evaluate.report_data:{n}" for n in (
        "TOP_IMAGES", "CORRELATED", "NEIGHBOURS", "IMAGE_DIMS", "ACTIVATION_BINS", "INCLUSION_BINS", "THUMBNAIL_PX",
        "FACTOR_VALUES", "dimension_cards", "image_table", "gate_summary", "factor_table", "training_curves",
        "report_data", "thumbnails")},
    # the novelty ROC curves beside the rest of novelty
    "bayesncl_pyro.evaluate.figures": {n: f"bayesncl_pyro.evaluate.novelty_figures:{n}" for n in ("ROC_SCORES",
                                                                                                   "plot_roc")},
}


def moved(module: str, name: str):
    """Return ``name`` of ``module`` from its new home, with a DeprecationWarning naming that home.

    A name that did not move raises AttributeError, as a module without ``__getattr__`` would.
    """
    target = MOVED.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, _, new_name = target.partition(":")
    warnings.warn(f"{module}.{name} moved to {new_module}.{new_name}; import it from there (the old path goes in "
                  f"bayesncl-pyro {REMOVED_IN})", DeprecationWarning, stacklevel=3)
    return functools.reduce(getattr, new_name.split("."), importlib.import_module(new_module))


def renamed(old: str, new: str):
    """Warn that ``old``, an attribute or a way of reading one, is now ``new``; called by the old form's accessor."""
    warnings.warn(f"{old} is now {new} (the old form goes in bayesncl-pyro {REMOVED_IN})", DeprecationWarning,
                  stacklevel=3)
