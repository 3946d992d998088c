"""The trainable object of a run, for CL, NCL and BayesNCL alike: a backbone and a BayesNCLHead built from a Config."""

import dataclasses
import inspect
from pathlib import Path

import torch
from torch import nn

from bayesncl_pyro._deprecated import moved
from bayesncl_pyro._version import __version__
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.head import BayesNCLHead, HeadOutput
from bayesncl_pyro.nn.encoders import build_backbone

# the head's arguments are named as the Config's fields (and the command-line flags): each is passed along
_HEAD_FIELDS = [f.name for f in dataclasses.fields(Config) if f.name in inspect.signature(BayesNCLHead).parameters]


def head_arguments(cfg: Config) -> dict:
    """The BayesNCLHead arguments of a run's config, but D and num_train.

    The :class:`BayesNCLHead` arguments of a run's config, but D and num_train: its fields of the same names, and
    for NCL and CL no prior.
    """
    args = {name: getattr(cfg, name) for name in _HEAD_FIELDS}
    if cfg.method != "bayesncl":
        args.update(prior=None, prior_args=None)
    return args


class ContrastiveLearner(nn.Module):
    """A backbone and the head built on it: the model a run trains.

    Owns the backbone (``cfg.encoder``, see ``encoders.py``) and the head (projector, Pyro model and guide,
    ELBO).

    ``forward(x)`` takes the 2B view-rows ``[view 1; view 2]`` and returns the head's ``(-ELBO / num_rows,
    monitoring values)`` (the loss: ``models/bayesncl.py``). Being an ``nn.Module``
    whose forward returns the loss, it can be wrapped by DDP as it is.
    """

    def __init__(self, cfg: Config, in_channels: int, num_train: int):
        super().__init__()
        self.cfg, self.in_channels = cfg, in_channels
        self.backbone, feat_dim = build_backbone(cfg.encoder, in_channels, cfg.image_size)
        self.head = BayesNCLHead(feat_dim, num_train=num_train, gather_distributed=True, **head_arguments(cfg))

    @property
    def gated(self) -> bool:
        """Whether the head has gates (BayesNCL), not NCL or CL."""
        return self.head.gated

    @property
    def model(self):
        """The head's Pyro model."""
        return self.head.model

    @property
    def guide(self):
        """The head's Pyro guide (None without gates)."""
        return self.head.guide

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
        """Images of 2B view-rows -> the head's (loss, HeadOutput)."""
        # autocast covers the backbone and the projector; the head runs its Pyro program at full precision. Its cache
        # of weights cast to bf16 is off in a step a CUDA graph captures, as PyTorch's CUDA graph notes ask
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp and x.is_cuda,
                            cache_enabled=not self.cfg.cuda_graphs):
            return self.head(self.backbone(x))

    @torch.no_grad()
    def representation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, F): backbone features and the representation the method uses (``BayesNCLHead.representation``)."""
        h = self.backbone(x).float()
        return h, self.head.representation(h)

    @torch.no_grad()
    def ungated_features(self, h: torch.Tensor) -> torch.Tensor:
        """The features of backbone features h with every gate open: normalise(relu(z)), as NCL's."""
        return self.head.ungated_features(h)

    def gate_probs(self, h: torch.Tensor) -> torch.Tensor:
        """Exact posterior inclusion probabilities q(g_k = 1 | x) under the run's gate estimator, R x K."""
        return self.head.gate_probs(h)

    def param_groups(self) -> list[dict]:
        """Optimizer groups (``BayesNCLHead.param_groups``): backbone and projector at the batch-scaled base lr."""
        cfg = self.cfg
        return self.head.param_groups(cfg.lr * cfg.batch_size / 256, cfg.gate_lr, self.backbone)


# bayesncl-pyro 0.1 named the learner's parts encoder.{backbone,projector}, model and guide; the head holds the
# projector, model and guide since 0.2
_RENAMED = (("encoder.backbone.", "backbone."), ("encoder.projector.", "head.projector."), ("model.", "head.model."),
            ("guide.", "head.guide."))

def load_weights(learner: ContrastiveLearner, state: dict, path: Path):
    """Load a checkpoint's weights, explaining a mismatch in one line.

    A 0.1 checkpoint's weights load under their current names; a mismatch (another version's model) is explained in
    one line instead of torch's state_dict error.
    """
    mine, theirs = learner.state_dict(), state["learner"]
    if any(k.startswith("encoder.") for k in theirs):
        theirs = {next((new + k[len(old):] for old, new in _RENAMED if k.startswith(old)), k): v
                  for k, v in theirs.items()}
    problems = [f"{k} is {tuple(theirs[k].shape)} there but {tuple(v.shape)} here"
                for k, v in mine.items() if k in theirs and theirs[k].shape != v.shape]
    problems += [f"{k} missing" for k in mine if k not in theirs]
    problems += [f"{k} unexpected" for k in theirs if k not in mine]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise UserError(f"{path} (bayesncl-pyro {state['version']}) does not fit the model of bayesncl-pyro "
                        f"{__version__}: {'; '.join(problems[:3])}{more}; load it with the version that wrote it")
    learner.load_state_dict(theirs)


def __getattr__(name: str):
    # load_learner moved to evaluate/loading (a run folder is read there, not in infer/)
    return moved(__name__, name)
