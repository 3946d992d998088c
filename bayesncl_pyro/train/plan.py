"""The runs of a comparison (experiments/compare.py): which to train, their names and Configs, and their records.

Each method of ``--methods`` becomes one or more named runs (:func:`method_configs`), trained at every seed into
``<out>/<name>-seed<k>/``; a run recorded with the same configuration in ``--record`` is reused, and every run trained
is recorded there (:data:`RECORD`: kilobytes, no checkpoint). ``evaluate/comparison.py`` puts the finished runs side by
side; ``train/budget.py`` chooses their epochs for ``--budget-minutes``.
"""

import itertools
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.config import Config
from bayesncl_pyro.infer.estimators import GATES

METHOD_NAMES = ("cl", "ncl", "ncl+topk", *(f"bayesncl-{g}" for g in GATES))
"""The names ``--methods`` takes: the baselines, and BayesNCL by its gate estimator."""

RECORD = (rundir.CONFIG, rundir.EVAL, rundir.LOG)  # what --record keeps of a run: kilobytes, no checkpoint


def method_configs(methods: list[str], priors: list[str], topk: int | list[int],
                   kl_weights: list[float] | None = None, densities: list[float] | None = None,
                   gate_heads: list[str] | None = None) -> dict[str, dict]:
    """Run name -> the Config fields that make that method.

    BayesNCL once per prior and, given several ``kl_weights``, once per lambda (one lambda is a shared setting), once
    per density in ``densities`` (named <method>-d<D> even for one: a density target makes another method than a
    fixed lambda), and once per gating head in ``gate_heads`` (a Bayesian one named <method>-bayesian); NCL+TopK once
    per k given several.
    """
    made = {}
    several = lambda values: values if values and len(values) > 1 else [None]  # noqa: E731
    topks = topk if isinstance(topk, list) else [topk]
    for m in methods:
        if m.startswith("bayesncl-"):
            for prior, lam, d, head in itertools.product(priors, several(kl_weights), densities or [None],
                                                         gate_heads or ["mlp"]):
                name = (m if prior == "bernoulli" else f"{m}+{prior}") + ("" if lam is None else f"-lambda{lam:g}") \
                    + ("" if d is None else f"-d{d:g}") + ("" if head == "mlp" else f"-{head}")
                made[name] = dict(method="bayesncl", gate=m.removeprefix("bayesncl-"), prior=prior,
                                  **({} if lam is None else {"kl_weight": lam}),
                                  **({} if d is None else {"gate_density": d}),
                                  **({} if head == "mlp" else {"gate_head": head}))
        elif m == "ncl+topk" and len(topks) > 1:
            made.update({f"ncl+topk-k{k}": dict(method="ncl", topk=k) for k in topks})
        else:
            made[m] = dict(method="cl") if m == "cl" else dict(method="ncl", topk=topks[0] if m == "ncl+topk" else 0)
    return made


def recorded_run(folder: Path, cfg: Config) -> bool:
    """Whether ``folder`` records a finished run of ``cfg``'s configuration (``--record``); a link is refused."""
    folder = rundir.inner_folder(folder)  # the user names the record, not the folders in it: one may point anywhere
    with rundir.RunFolder.open(folder) as kept:  # what is checked is what is compared
        return all(kept.exists(name) for name in RECORD) and not rundir.differences(folder, cfg)


def record(run_dir: Path, folder: Path):
    """Copy a finished run's record into ``folder`` (``--record``).

    ``folder`` is a real folder of the record's, by the rule of ``rundir``: read and written never through a link, the
    three files replaced together.
    """
    folder = rundir.output_folder(folder)
    with rundir.RunFolder.open(run_dir) as run:  # the three files of one run, whatever its path leads to meanwhile
        rundir.save_together([(run.read_bytes(name, rundir.TEXT_LIMIT), folder / name) for name in RECORD])


def train_time(run_dir: Path, batch_size: int) -> float:
    """Seconds a run spent in training steps, from its log.jsonl.

    Summed from log.jsonl (each line's images / images_per_s); steps replayed after a resume are counted once.
    """
    by_step = {rec["step"]: rec["images_per_s"] for rec in rundir.read_log(run_dir)}
    total, last = 0.0, 0
    for step in sorted(by_step):
        total += (step - last) * batch_size / by_step[step]
        last = step
    return total


def shared_settings(cfg: Config, several_lambdas: bool) -> dict:
    """The settings every run of a comparison shares: ``cfg``'s identity less what differs between runs.

    ``cfg``: one run's Config, a gated one's where there are gates; lambda differs too where there are
    ``several_lambdas``.
    """
    per_run = {"method", "gate", "prior", "topk", "seed", "gate_density", "gate_head"} | (
        {"kl_weight"} if several_lambdas else set())
    return {k: v for k, v in cfg.identity().items() if k not in per_run}
