"""The gate posterior as ArviZ ``InferenceData``, saved as ``gates.nc`` next to the checkpoint.

All ArviZ code of the project lives here, so that moving to arviz 1.x (DataTree, Python >= 3.12)
touches this file only. Layout of the data (dims ``item``, ``feature``, ``class``, ``step``; every
``item`` coordinate also carries its ``class_label``):

    posterior       g (chain, draw, item, feature)   0/1 gate draws from the guide q(g | x)
                    dim_inclusion (chain, draw, feature)   share of test items whose gate is on
                    rate (chain, draw, feature)       global inclusion rate (beta-bernoulli prior only)
    observed_data   label (item)
    gates           inclusion_prob (item, feature)    exact q(g_k = 1 | x_i) from the logits
                    class_inclusion (class, feature)  its mean over the items of each class
                    features (item, feature)          the representation F the metrics judge
                    rate_a, rate_b (feature)          q(rate_k) = Beta(a_k, b_k) (beta-bernoulli only)
    training_log    every numeric field of log.jsonl (step): -ELBO per row (loss), nce, kl, ...

The run configuration is in the attributes: ``config`` (JSON) and one attribute per scalar field.
"""

import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from bayesncl_pyro.posterior import GatePosterior, gate_posterior
from bayesncl_pyro.training import read_log

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # arviz 0.2x announces its 1.x refactor on import
    import arviz as az

GATES_FILE = "gates.nc"
ENGINE = "h5netcdf"
DEFAULT_DRAWS = 10  # S x N x K bytes on disk: 10 draws of 10k items x 256 dims is 26 MB before compression


def to_inference_data(post: GatePosterior, log: list[dict] = (), config: dict | None = None) -> az.InferenceData:
    """ArviZ data of a gate posterior with draws (see the module docstring for the layout)."""
    if post.draws is None:
        raise ValueError("the gate posterior has no draws; call gate_posterior(..., num_draws=S) with S >= 1")
    item_coords = {"item": np.arange(len(post.labels)), "feature": np.arange(post.probs.shape[1]),
                   "class": list(post.classes)}
    posterior = {"g": post.draws.to(torch.int8)[None].numpy(),
                 "dim_inclusion": post.draws.float().mean(1)[None].numpy()}
    dims = {"g": ["item", "feature"], "dim_inclusion": ["feature"], "rate": ["feature"], "label": ["item"]}
    if post.rate_draws is not None:
        posterior["rate"] = post.rate_draws[None].numpy()
    config = config or {}
    attrs = {"config": json.dumps(config), **{k: v for k, v in config.items() if type(v) in (int, float, str)}}
    idata = az.from_dict(posterior=posterior, observed_data={"label": post.labels.numpy()}, coords=item_coords,
                         dims=dims)
    gates = {"inclusion_prob": (("item", "feature"), post.probs.numpy()),
             "class_inclusion": (("class", "feature"), post.class_means.numpy()),
             "features": (("item", "feature"), post.features.numpy())}
    if post.rate_beta is not None:
        gates.update(rate_a=("feature", post.rate_beta[0].numpy()), rate_b=("feature", post.rate_beta[1].numpy()))
    groups = {"gates": xr.Dataset(gates, coords=item_coords)}
    numeric = sorted({k for rec in log for k, v in rec.items() if type(v) in (int, float) and k != "step"})
    if log:
        groups["training_log"] = xr.Dataset(
            {k: ("step", np.array([rec.get(k, np.nan) for rec in log], dtype=float)) for k in numeric},
            coords={"step": [rec["step"] for rec in log]})
    idata.add_groups(groups)
    class_label = ("item", np.asarray(post.classes)[post.labels.numpy()])
    for name in ("posterior", "observed_data", "gates"):
        idata[name] = idata[name].assign_coords(class_label=class_label)
    for name in idata.groups():
        idata[name].attrs.update(attrs)
    return idata


def export_gates(run_dir: str | os.PathLike, learner=None, data=None, num_draws: int = DEFAULT_DRAWS) -> Path:
    """Compute the gate posterior of a run, write ``RUN_DIR/gates.nc`` and return its path.

    ``learner`` and ``data`` default to the run's checkpoint and dataset (pass them to skip reloading).
    """
    run_dir = Path(run_dir)
    post = gate_posterior(learner if learner is not None else run_dir, data, num_draws=max(num_draws, 1))
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else None
    idata = to_inference_data(post, read_log(run_dir), config)
    path = run_dir / GATES_FILE
    tmp = path.with_name(path.name + ".tmp")
    idata.to_netcdf(str(tmp), engine=ENGINE)
    os.replace(tmp, path)
    return path


def read_gates(path: str | os.PathLike) -> az.InferenceData:
    """Load a ``gates.nc`` (a run folder is accepted too) fully into memory."""
    path = Path(path)
    if path.is_dir():
        path = path / GATES_FILE
    with az.rc_context({"data.load": "eager"}):  # lazy loading would keep the file open
        return az.from_netcdf(str(path), engine=ENGINE)
