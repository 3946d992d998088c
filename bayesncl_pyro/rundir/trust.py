"""Trust: the code a run's configuration names is imported only when asked, and a file is trusted by where it lies."""

import os
from pathlib import Path

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.plugins import TIMM, is_spec
from bayesncl_pyro.rundir.layout import CHECKPOINT, CONFLICT, EVAL, GATES_FILE, LOG, MARKER, logger


def code_references(cfg: Config) -> dict[str, str]:
    """Return the settings of ``cfg`` that name code to import (``package.module:name``): setting -> reference.

    An encoder ``timm:NAME`` is a model of the installed timm; a prior has no such form, and its ``timm:X`` imports a
    module. An encoder left None (the dataset's, before ``resolve``) names none.
    """
    prior = cfg.prior if cfg.method == "bayesncl" else None  # NCL and CL never build their config's prior
    return {flag: spec for flag, spec in (("encoder", cfg.encoder), ("prior", prior))
            if spec is not None and is_spec(spec) and not (flag == "encoder" and spec.startswith(TIMM))}


def check_config_code(path: str | os.PathLike, values: dict, trust: bool):
    """Refuse (or, trusted, announce) the code that a config file of a run folder names, as :func:`check_code`.

    ``values``: the fields the run takes from the file (``run_svi.py --config``). Whose file it is follows from where
    it lies (:func:`written_elsewhere`), never from what stands beside it only: a run's, a record's or another user's
    file names its writer's code. Another file is the user's own.
    """
    path = Path(path)
    if written_elsewhere(path):
        check_code(Config(**{k: values[k] for k in ("encoder", "prior") if k in values}), path, trust)


# the files that a run, or a record of one (compare.py --record keeps config.json, eval.json and log.jsonl), writes:
# a folder that holds one of them, or lies in one that does, is no place of the user's own configuration
_WRITTEN = (MARKER, CHECKPOINT, EVAL, LOG, CONFLICT, GATES_FILE)


def written_elsewhere(path: Path) -> bool:
    """Whether the file at ``path`` is its writer's, not the user's own.

    As git trusts a repository by where it lies and whose it is (``safe.directory``), not by what it holds: a file in a
    run folder or a record of one (a folder that holds a file a run writes, at any depth above the file, by the path
    named and by the link's target), or one owned by another user.
    """
    path = Path(os.path.abspath(path))
    for named in (path, path.resolve()):
        for folder in named.parents:
            if any(os.path.lexists(folder / name) for name in _WRITTEN):
                return True
    try:
        return os.stat(path).st_uid != os.geteuid()
    except OSError:
        return False


def check_code(cfg: Config, path: Path, trust: bool):
    """Refuse (or, trusted, announce) the modules that the encoder and prior of the run at ``path`` would import."""
    code = code_references(cfg)
    if not code:
        return
    named = ", ".join(f"{flag} {spec} (module {spec.partition(':')[0]})" for flag, spec in code.items())
    if not trust:
        raise UserError(f"{path} names code that opening it would import and run: {named}; open it with "
                        "--trust-run (trust_code=True in Python) only if you trust whoever wrote the run")
    logger.warning(f"note: trusting {path}: importing its {named}")
