"""A trained run's weights as plain state_dicts, for use without this project.

The backbone's and the head's state_dicts, and the lines of code that load them (experiments/export.py).
"""

from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.infer.learner import head_arguments
from bayesncl_pyro.nn.encoders import torchvision_code


def export_weights(run_dir: Path, out: Path, head_out: Path | None = None, trust_code: bool = False) -> list[str]:
    """Write the backbone's and the head's state_dicts and return the code that loads them.

    Written together (``rundir.save_together``: both new or both as they were); returns what was written and the lines
    that load them. An export never replaces a file of a run (this one or another): a path named as one (checkpoint.pt,
    log.jsonl, gates.nc, ...) or inside a folder a run keeps (report/, ...) is refused: ``rundir.check_not_a_run_file``.
    """
    head_out = head_out or out.with_name(f"{out.stem}_head{out.suffix or '.pt'}")
    for flag, path in (("--out", out), ("--head-out", head_out)):
        rundir.check_not_a_run_file(path, flag)
    if out.resolve() == head_out.resolve():
        raise UserError(f"--out and --head-out are both {out}; give them two names")
    learner, cfg = load_learner(run_dir, trust_code=trust_code)
    for path in (out, head_out):
        rundir.output_folder(path.parent, named=True)
    backbone, head = learner.backbone.state_dict(), learner.head.state_dict()
    # into a run folder (the default) under its lock, as every write: refused while a run trains there
    rundir.save_together([(backbone, out), (head, head_out)])
    channels, size = learner.in_channels, cfg.image_size
    feature_dim = learner.head.projector[0].in_features
    build = torchvision_code(cfg.encoder, channels, size) or [
        "from bayesncl_pyro.nn.encoders import build_backbone",
        f"backbone, _ = build_backbone({cfg.encoder!r}, {channels}, {size})"]
    arguments = "".join(f", {k}={v!r}" for k, v in head_arguments(cfg).items())
    return [f"wrote {out}: the {cfg.encoder} backbone's state_dict ({len(backbone)} tensors; {channels} x {size} x "
            f"{size} images -> {feature_dim} features)",
            f"wrote {head_out}: the {cfg.method} head's state_dict (BayesNCLHead: projector"
            + (", gating head, prior)" if learner.gated else ")"),
            "load them with:",
            "    import torch, torchvision" if build[0].startswith("backbone = torchvision") else "    import torch",
            *("    " + line for line in build),
            f"    backbone.load_state_dict(torch.load({str(out)!r}))",
            "    from bayesncl_pyro import BayesNCLHead",
            f"    head = BayesNCLHead({feature_dim}, num_train={learner.head.num_rows // 2}{arguments})",
            f"    head.load_state_dict(torch.load({str(head_out)!r}))"]
