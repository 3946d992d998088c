"""The ten-seed result a single run is read beside: the default recipe's shipped records, summarised.

One seed cannot carry a verdict: on the compositional benchmark the default run's closing comparison (the gates
against post-hoc TopK on the top-N consistency) moves by more than its own size with the seed and even with the number
of CPU threads. So the run's summary puts its figures beside the ten-seed result of the same recipe, recorded in the
repository's ``docs/results/verdict-comp/`` (docs/RESULTS.md, "At matched sparsity"). An installed package has no
``docs/``: the few figures the summary quotes are computed from those records by :func:`summarise` and shipped
beside this module as :data:`SUMMARY` (package data); ``tests/evaluate/test_verdict.py`` recomputes it from the
records and checks that the two agree. Redo it after the records change with
``python -c "from bayesncl_pyro.evaluate import verdict; verdict.write()"`` from the repository's root.
"""

import json
import math
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.config import Config
from bayesncl_pyro.evaluate import keys
from bayesncl_pyro.evaluate.stats import interval

SUMMARY = Path(__file__).with_name("verdict_comp.json")
"""The shipped summary of the ten-seed records (package data)."""
RECORDS = Path("docs/results/verdict-comp")
"""Where the repository keeps the records it is computed from, relative to the repository's root."""
METHOD = "bayesncl-ste"
"""The records' name of the default run's method (the published prior; ``-d0.3`` runs are another recipe)."""


_UNGATED = keys.format("semantic_consistency", keys.UNGATED)  # the paper's consistency with every gate open


def _differences(evals: list[dict]) -> dict[str, list[float]]:
    """Per run, the two differences the closing sentence is about, and the figures it quotes."""
    posthoc = [e["controls"]["posthoc_topk"] for e in evals]
    return {
        # the gates' choice of entries against each image's largest ones, on the consistency sparsity cannot game
        "gates_minus_posthoc_topn": [e["semantic_consistency_topn"] - p["semantic_consistency_topn"]
                                     for e, p in zip(evals, posthoc)],
        # what sparsity alone does to the paper's consistency: the same features, as sparse, without the gates
        "sparsity_rise_paper": [p["semantic_consistency"] - e[_UNGATED]
                                for e, p in zip(evals, posthoc)],
        "semantic_consistency": [e["semantic_consistency"] for e in evals],
        _UNGATED: [e[_UNGATED] for e in evals],
        "posthoc_semantic_consistency": [p["semantic_consistency"] for p in posthoc],
        "dims_tracking_class": [e["dims_tracking_class"] for e in evals],
    }


def summarise(records: Path = RECORDS) -> dict:
    """The ten-seed summary of the default recipe's records in ``records``.

    Args:
        records: a folder of ``compare.py --record`` runs holding ``bayesncl-ste-seed<N>/``.

    Returns:
        The recipe (its Config identity without the seed), the seeds, N of the top-N consistency, and for each figure
        its mean, standard deviation, range and, for the two differences, the 95 % t interval with the seeds above and
        below zero; fractions, rounded to 6 decimals (the sentence prints 3: no rounding twice).
    """
    # each record folder by the rule of rundir: a linked one (which may point anywhere) is refused, not followed
    folders = sorted((rundir.inner_folder(f) for f in records.glob(f"{METHOD}-seed*")),
                     key=lambda f: int(f.name.rsplit("seed", 1)[1]))
    if not folders:
        raise FileNotFoundError(f"no {METHOD}-seed* runs in {records}; run this from the repository's root")
    configs, evals = [], []
    for folder in folders:
        with rundir.RunFolder.open(folder) as kept:  # a run's config and evaluation from one folder
            configs.append(Config.from_dict(kept.read_json(rundir.CONFIG)))
            evals.append(kept.read_json(rundir.EVAL))
    recipes = [{k: v for k, v in c.identity().items() if k != "seed"} for c in configs]
    if any(r != recipes[0] for r in recipes):
        raise ValueError(f"the runs in {records} are not one recipe over seeds")
    out = dict(records=str(RECORDS), method=METHOD, recipe=recipes[0], seeds=[c.seed for c in configs],
               topn_n=evals[0]["topn_n"])
    for key, values in _differences(evals).items():
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        figure = dict(mean=mean, sd=sd, min=min(values), max=max(values))
        if key in ("gates_minus_posthoc_topn", "sparsity_rise_paper"):
            i = interval(values)
            figure.update(low=i["t_low"], high=i["t_high"], above=i["above"], below=i["below"])
        out[key] = {k: round(v, 6) if isinstance(v, float) else v for k, v in figure.items()}
    return out


def write(records: Path = RECORDS):
    """Recompute :data:`SUMMARY` from ``records`` (after the records change)."""
    rundir.output_folder(SUMMARY.parent, named=True)
    rundir.atomic_save((json.dumps(summarise(records), indent=1) + "\n").encode(), SUMMARY)


def shipped() -> dict:
    """The shipped summary, :data:`SUMMARY`."""
    return json.loads(SUMMARY.read_text())


def same_recipe(cfg: Config, summary: dict) -> bool:
    """Whether ``cfg`` (with its recipe filled in) trains what the summary's runs trained, whatever the seed."""
    mine = {k: v for k, v in cfg.identity().items() if k != "seed"}
    return json.loads(json.dumps(mine)) == summary["recipe"]  # through JSON: a tuple reads as the file's list


def _where(figure: dict) -> str:
    """Where a ten-seed interval lies, in words: only the interval decides, never one run's figure.

    An interval that holds zero is no equivalence: it is said as what it rules out.
    """
    if figure["low"] > 0 or figure["high"] < 0:
        side = "above" if figure["low"] > 0 else "below"
        return f"so the gates' choice of entries is {side} keeping each image's largest ones"
    return (f"so the ten seeds do not separate the gates' choice of entries from keeping each image's largest ones "
            f"(a gain above {figure['high']:+.3f} or a loss below {figure['low']:+.3f} is ruled out at 95 %)")


def closing_sentence(results: dict, cfg: Config, summary: dict | None = None) -> str:
    """The closing sentence of a gated run's summary: this run's figures beside the ten-seed result.

    The words come from the shipped ten-seed interval alone, so that two runs whose figures differ by noise (another
    seed, another thread count) close with the same sentence; this run's own figures stand beside it as digits.

    Args:
        results: the run's eval dict, with its post-hoc TopK control and the top-N consistency.
        cfg: the run's Config, its recipe filled in: the ten-seed result is quoted as this run's only for its recipe.
        summary: the ten-seed summary; by default the shipped one (:func:`shipped`).
    """
    summary = shipped() if summary is None else summary
    posthoc = results["controls"]["posthoc_topk"]
    n = results["topn_n"]
    diff = results["semantic_consistency_topn"] - posthoc["semantic_consistency_topn"]
    rise = posthoc["semantic_consistency"] - results[_UNGATED]
    mine = (f"one seed cannot carry a verdict: on this run the gates minus post-hoc TopK is {diff:+.3f} on the top-{n} "
            f"consistency, and sparsity alone (post-hoc TopK against every gate open) moves the paper's consistency "
            f"by {rise:+.3f}")
    if not same_recipe(cfg, summary):
        return (f"{mine}; docs/RESULTS.md (\"At matched sparsity\") pairs {len(summary['seeds'])} seeds of the default "
                "recipe, not this run's: experiments/compare.py --seeds 0 1 2 ... pairs seeds of this one")
    d, s = summary["gates_minus_posthoc_topn"], summary["sparsity_rise_paper"]
    return (f"{mine}; over {len(summary['seeds'])} seeds of this recipe ({summary['records']}, docs/RESULTS.md "
            f"\"At matched sparsity\"): gates minus post-hoc TopK {d['mean']:+.3f} [95 % interval {d['low']:+.3f}, "
            f"{d['high']:+.3f}] on the top-{summary['topn_n']} consistency (seeds from {d['min']:+.3f} to "
            f"{d['max']:+.3f}), {_where(d)}; "
            f"sparsity alone {s['mean']:+.3f} [{s['low']:+.3f}, {s['high']:+.3f}] on the paper's")
