"""The gate posterior as ArviZ data, saved as ``gates.nc`` next to the checkpoint.

All ArviZ code of the project lives here. ArviZ 1.x (Python >= 3.12, split into arviz-base, arviz-stats
and arviz-plots) is the main path: its data is an ``xarray.DataTree`` with one child node per group, built
with ``arviz_base.from_dict``. On Python 3.11 pip can only install arviz 0.2x, whose ``InferenceData`` holds
the same groups; the ``*_arviz0`` helpers at the end are the only code that knows about it. Both
versions write and read the file with xarray's own DataTree netCDF code (one netCDF4 group per ArviZ group,
through h5netcdf), so a ``gates.nc`` written under either version reads under the other.

Layout of the data (dims ``item``, ``feature``, ``class``, ``step``; every ``item`` coordinate also carries
its ``class_label``)::

    posterior       g (chain, draw, item, feature)   0/1 gate draws from q(g | x) = Bernoulli(inclusion_prob)
                    dim_inclusion (chain, draw, feature)   share of test items whose gate is on
                    <site> (chain, draw, ...)         each global latent of the prior by its site name, drawn
                                                      from its q (beta-bernoulli: rate (chain, draw, feature))
                    <site> (chain, draw, item, ...)   each latent per image of the prior (per-image: image_rate),
                                                      drawn from its q given the image
    observed_data   label (item)
    gates           inclusion_prob (item, feature)    exact q(g_k = 1 | x_i) of the run's gate estimator
                    class_inclusion (class, feature)  its mean over the items of each class
                    features (item, feature)          the representation F the metrics judge
                    rate_<param> (feature or ...)     each parameter of the global latents' q by its name
                                                      (beta-bernoulli: rate_a, rate_b, q(rate_k) = Beta(a_k, b_k))
                    prior_param_<p> (feature or ...)  each learned parameter of the prior itself by its name
                                                      (learned: prior_param_logit_rate; a mixture's weights)
                    prior_rate (feature)              the prior's inclusion rate, a hierarchical prior's at the
                                                      mean of its latents' q; (item, feature) for a prior with a
                                                      rate per image, each test image's
    training_log    every numeric field of log.jsonl (step): the loss per row as trained (-ELBO, or for ste and
                                                      gs-reference-kl the reference's surrogate), nce, kl, ...

The posterior group's attributes ``inference`` and ``note`` say what its draws are: independent draws from the
trained guide (variational inference), not MCMC, so one chain and no R-hat. For a prior with a convergence figure
(``Prior.convergence``) the global latents' variables carry the attributes ``converged`` ("yes" or "no") and
``note``: for beta-bernoulli, q(rate) is trained by SGD, whose steps move its mean to the data quickly but its
concentration a + b only slowly towards the conjugate posterior's (models/priors.py, BetaBernoulliPrior), so after a
run on a large data set its spread says how far training got, not how uncertain the rates are.

The run configuration is in the attributes of the root and of every group: ``config`` (JSON) and one
attribute per scalar field.
"""

import json
import os
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.heldout import TestFeatures
from bayesncl_pyro.evaluate.posterior import GatePosterior, gate_posterior
from bayesncl_pyro.rundir import CONFIG, DATA_LIMIT, GATES_FILE, RunFolder, atomic_save, held, open_file

ENGINE = "h5netcdf"
DEFAULT_DRAWS = 10  # S x N x K bytes on disk: 10 draws of 10k items x 256 dims is 26 MB before compression
POSTERIOR_NOTE = ("independent draws from the trained amortized guide q(g | x) = Bernoulli(gates.inclusion_prob) "
                  "(and q(rate)), not MCMC: one chain, R-hat and ESS do not apply")
ARVIZ_1 = int(version("arviz").split(".")[0]) >= 1  # from the metadata: importing arviz 1.x takes ~2 s


def to_datatree(post: GatePosterior, log: list[dict] = (), config: dict | None = None) -> xr.DataTree:
    """ArviZ data of a gate posterior with draws (see the module docstring for the layout)."""
    if post.draws is None:
        raise ValueError("the gate posterior has no draws; call gate_posterior(..., num_draws=S) with S >= 1")
    coords = {"item": np.arange(len(post.labels)), "feature": np.arange(post.probs.shape[1]),
              "class": list(post.classes)}
    class_label = ("item", np.asarray(post.classes)[post.labels.numpy()])
    posterior = {"g": post.draws.to(torch.int8)[None].numpy(),  # [None]: one chain
                 "dim_inclusion": post.draws.float().mean(1)[None].numpy()}
    dims = {"g": ["item", "feature"], "dim_inclusion": ["feature"], "label": ["item"]}
    k = post.probs.shape[1]
    for name, values in (post.global_draws or {}).items():  # a global latent of K values is per feature
        posterior[name] = values[None].numpy()
        if values.shape[1:] == (k,):
            dims[name] = ["feature"]
    for name, values in (post.row_draws or {}).items():  # a latent per image: S x N x ...
        posterior[name] = values[None].numpy()
        dims[name] = ["item"] + (["feature"] if values.shape[2:] == (k,) else
                                 [f"{name}_dim_{i}" for i in range(values.ndim - 2)])
    groups = {"posterior": posterior, "observed_data": {"label": post.labels.numpy()}}
    dt = (_from_dict if ARVIZ_1 else _from_dict_arviz0)(groups, coords, dims)
    for name in ("posterior", "observed_data"):
        dt[name].coords["class_label"] = class_label

    gates = {"inclusion_prob": (("item", "feature"), post.probs.numpy()),
             "class_inclusion": (("class", "feature"), post.class_means.numpy()),
             "features": (("item", "feature"), post.features.numpy())}
    for name, value in (post.global_params or {}).items():  # q's parameters of the global latents, as rate_<name>
        gates[f"rate_{name}"] = (("feature",) if value.shape == (k,) else
                                 tuple(f"rate_{name}_dim_{i}" for i in range(value.ndim)), value.numpy())
    for name, value in (post.prior_params or {}).items():  # the prior's own learned parameters: prior_param_<name>
        name = f"prior_param_{name.replace('.', '_')}"
        gates[name] = (("feature",) if value.shape == (k,) else
                       tuple(f"{name}_dim_{i}" for i in range(value.ndim)), value.numpy())
    if post.prior_rate is not None:
        gates["prior_rate"] = (("item", "feature")[-post.prior_rate.ndim:], post.prior_rate.numpy())
    dt["gates"] = xr.Dataset(gates, coords={**coords, "class_label": class_label})
    if post.global_convergence is not None:
        _mark_rate_convergence(dt, post)
    if log:
        numeric = sorted({k for rec in log for k, v in rec.items() if type(v) in (int, float) and k != "step"})
        dt["training_log"] = xr.Dataset(
            {k: ("step", np.array([rec.get(k, np.nan) for rec in log], dtype=float)) for k in numeric},
            coords={"step": [rec["step"] for rec in log]})

    config = config or {}
    attrs = {"config": json.dumps(config), **{k: v for k, v in config.items() if type(v) in (int, float, str)}}
    for node in dt.subtree:  # the root and every group
        node.attrs.update(attrs)
    dt["posterior"].attrs.update(inference="variational", note=POSTERIOR_NOTE)
    return dt


def _mark_rate_convergence(dt: xr.DataTree, post: GatePosterior):
    """Say on every rate variable whether q(rate) reached its posterior's concentration (within 10 %).

    The mean of q follows the data long before.
    """
    concentration, optimum = post.global_convergence
    converged = concentration >= 0.9 * optimum
    note = (f"q(rate) as SGD left it: concentration a + b {concentration:.0f} (mean over features) against "
            f"{optimum:.0f} (a0 + b0 + 2N) for the conjugate posterior it tends to; "
            + ("reached" if converged else "its mean follows the data, but its spread is how far training got, "
               "not the rates' uncertainty (models/priors.py, BetaBernoulliPrior)"))
    names = [("gates", f"rate_{name}") for name in post.global_params] + [("posterior", name)
                                                                          for name in post.global_draws or {}]
    for group, name in names:
        dt[group][name].attrs.update(converged="yes" if converged else "no", note=note)


def export_gates(run_dir: str | os.PathLike, learner=None, data=None, num_draws: int = DEFAULT_DRAWS,
                 test: TestFeatures | None = None, trust_code: bool = False) -> Path:
    """Compute the gate posterior of a run, write ``RUN_DIR/gates.nc`` and return its path.

    A failed write raises ``UserError`` and leaves any previous ``gates.nc`` unchanged and no temporary file.

    Args:
        run_dir: the run folder.
        learner: the run's trained learner; by default loaded from its checkpoint (pass it to skip reloading).
        data: the dataset; by default the run's own.
        num_draws: gate draws per test item from q(g | x) (at least 1).
        test: the learner's test features, when the caller has them (the evaluation's): the backbone is not run
            again.
        trust_code: import the code that the run's configuration names (a prior of your own), as ``load_run``.

    Returns:
        The path of the ``gates.nc`` written.

    Examples:
        >>> export_gates(run_dir).name  # a BayesNCL run writes it when it ends; this writes it again
        'gates.nc'
    """
    run_dir = Path(run_dir)
    path = run_dir / GATES_FILE
    # the run folder opened once: its checkpoint, config and log read, and gates.nc written, in the same folder
    with RunFolder.open(run_dir) as run:
        post = gate_posterior(learner if learner is not None else run_dir, data, num_draws=max(num_draws, 1),
                              test=test, trust_code=trust_code)
        dt = to_datatree(post, run.read_log(), run.read_json(CONFIG) if run.exists(CONFIG) else None)
        try:  # a failed write (disk full, read-only folder) is a UserError; under the run's lock, as every writer's
            with held(run_dir):
                atomic_save(lambda f: dt.to_netcdf(f, engine=ENGINE), path)
        except ImportError as e:  # h5netcdf >= 1.8 no longer installs h5py by itself
            raise UserError(f"cannot write {path}: {e}; pip install 'h5netcdf[h5py]'") from None
    return path


def read_gates(path: str | os.PathLike):
    """Load a ``gates.nc`` (a run folder is accepted too) fully into memory.

    Args:
        path: a ``gates.nc``, or the run folder holding one.

    Returns:
        What the installed ArviZ's functions (``az.summary``, the plots) take: an ``xarray.DataTree`` with arviz 1.x,
        an ``arviz.InferenceData`` with arviz 0.2x. Both give ``data.posterior``, ``data["gates"]["class_inclusion"]``
        and so on.

    Raises:
        UserError: there is no such file, or it is not a gates file this version reads.

    Examples:
        >>> data = read_gates(run_dir)  # az.summary(data.posterior), az.plot_forest(...) take it
        >>> sorted(data.posterior.data_vars)
        ['dim_inclusion', 'g']
    """
    path = Path(path)
    if path.is_dir():
        path = path / GATES_FILE
    if not os.path.lexists(path):
        raise UserError(f"no gates file at {path}; run_svi.py writes one when a BayesNCL run ends, and "
                        f"python experiments/inspect_gates.py {path.parent} --export writes it from the checkpoint")
    with open_file(path, DATA_LIMIT) as f:
        _check_storage(f, path)
        with xr.open_datatree(f, engine=ENGINE) as lazy:
            dt = lazy.load()  # into memory, so that the file is closed when this returns
    return dt if ARVIZ_1 else _to_inference_data_arviz0(dt)


# The most a gates.nc is read up to once decompressed, for each byte of the file: a run writes it uncompressed, and
# a user's recompression (nccopy -d) of its 0/1 gates shrinks it some tens of times; zeros compress a thousandfold
EXPANSION, EXPANSION_SLACK = 64, 64 * 2**20


def _check_storage(f, path: Path):
    """Refuse a gates.nc (open as ``f``) whose data lie outside it, or would decompress past what it may hold.

    Refused: an HDF5 external-storage variable, a virtual dataset or an external link (each reads another file, which
    may be any file: its bytes would come back as gates), and data that decompress to more than ``EXPANSION`` times
    the file's size (plus ``EXPANSION_SLACK``). ``f`` is at its start again after.
    """
    import h5py  # late: h5netcdf's HDF5 backend, which the read below imports anyway

    fix = "it is not what a run writes, move it away"
    found, total = [], 0

    def variable(name, obj):
        nonlocal total
        if isinstance(obj, h5py.Dataset):
            if obj.external:
                found.append(f"its variable /{name} keeps its data in another file (HDF5 external storage), which a "
                             "run's gates.nc never does (it may be any file)")
            elif obj.is_virtual:
                found.append(f"its variable /{name} is a virtual dataset, whose data lie in other files, which a run's "
                             "gates.nc never holds (they may be any file)")
            total += obj.size * obj.dtype.itemsize

    with h5py.File(f, "r") as h5:
        h5.visit_links(lambda name: found.append(
            f"its link /{name} leads into another file (an HDF5 external link), which a run's gates.nc never holds "
            "(it may be any file)") if isinstance(h5.get(name, getlink=True), h5py.ExternalLink) else None)
        if not found:
            h5.visititems(variable)
    if found:
        raise UserError(f"{path}: {found[0]}: {fix}")
    size = os.fstat(f.fileno()).st_size
    if total > EXPANSION * size + EXPANSION_SLACK:
        raise UserError(f"{path} holds {size:,} bytes that decompress to {total:,}, more than the "
                        f"{EXPANSION * size + EXPANSION_SLACK:,} a gates.nc of its size is read up to; {fix}")
    f.seek(0)


def _from_dict(groups: dict, coords: dict, dims: dict) -> xr.DataTree:
    from arviz_base import from_dict  # late: ArviZ 1.x only; arviz-base alone (`import arviz` loads its stats, plots)

    return from_dict(groups, coords=coords, dims=dims)


# -- arviz 0.2x (Python 3.11) ----------------------------------------------------------------------


def _arviz0():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # arviz 0.2x announces its 1.x refactor on import
        import arviz  # late: ArviZ 0.2x only, under the filter above

    return arviz


def _from_dict_arviz0(groups: dict, coords: dict, dims: dict) -> xr.DataTree:
    return _arviz0().from_dict(**groups, coords=coords, dims=dims).to_datatree()


def _to_inference_data_arviz0(dt: xr.DataTree):
    return _arviz0().InferenceData.from_datatree(dt)
