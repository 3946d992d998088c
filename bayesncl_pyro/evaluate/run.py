"""A trained run folder as an object: ``load_run("runs/x")``.

    run = load_run("runs/x")
    probs = run.gate_probs("photos/")          # N x K, q(g_k = 1 | x) of every image in the folder
    feats = run.representation(pil_images)     # N x K, the representation the method uses
    post = run.posterior(num_draws=100)        # the gate posterior on the run's test split

Images are given as a folder (its image files, sorted by name: :func:`image_paths` lists them), an image
file, a PIL image, a uint8 tensor (0-255) or a float tensor (0-1), ``C x H x W`` or ``N x C x H x W``, or a
list of any of these. Each goes through the run's own evaluation transform (``data.views.eval_transform``
at the run's image size and channels), as the test split did in training.
"""

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from PIL import Image

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.images import IMAGE_EXTENSIONS, open_image
from bayesncl_pyro.data.views import eval_transform
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.rundir import run_folder


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu", *, trust_code: bool = False,
             data_dir: str | os.PathLike | None = None) -> "TrainedRun":
    """Load the trained run in ``run_dir`` as a :class:`TrainedRun`.

    A run folder is data: one whose encoder or prior is code of its writer's (``package.module:name``) is refused
    unless ``trust_code=True``, which imports it (``evaluate.loading.load_learner``).

    Args:
        run_dir: a folder written by ``experiments/run_svi.py`` or a :class:`~bayesncl_pyro.Trainer`, or its
            ``checkpoint.pt``.
        device: where the learner goes: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        trust_code: import the code that the run's configuration names (an encoder or a prior of your own).
        data_dir: the run's data folder, where it moved (by default the run's own when it is an absolute path outside
            the run folder).

    Returns:
        The run: its learner, config and evaluation transform, and what they compute on new images.

    Raises:
        UserError: ``run_dir`` holds no finished checkpoint, or names code that ``trust_code`` does not allow.

    Examples:
        >>> run = load_run(run_dir)  # a BayesNCL run on the digits (8 x 8 grey images), K = 16
        >>> run.cfg.method, run.cfg.proj_dim
        ('bayesncl', 16)
        >>> run.gate_probs(torch.rand(5, 1, 8, 8)).shape  # or a folder of images, files, PIL images
        torch.Size([5, 16])
    """
    learner, cfg = load_learner(run_dir, device, trust_code=trust_code, data_dir=data_dir)
    return TrainedRun(learner, cfg, run_folder(run_dir))


def image_paths(folder: str | os.PathLike) -> list[Path]:
    """The image files directly in ``folder``, sorted by name: the order of the rows of a folder's results."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


class TrainedRun:
    """A run's trained learner, its config (``cfg``) and its evaluation transform (``transform``): :func:`load_run`'s.

    Images are given as in the module's docstring (a folder, files, PIL images, tensors, or a list of them); every
    method returns tensors on the CPU, a row per image.

    Args:
        learner: the trained ``ContrastiveLearner`` (backbone and head), as ``run.learner``.
        cfg: the run's :class:`~bayesncl_pyro.Config`, as ``run.cfg``.
        run_dir: the run folder, as ``run.dir``.

    Examples:
        >>> run = load_run(run_dir)
        >>> images = torch.rand(5, 1, 8, 8)  # the run's size and channels; a larger image is resized
        >>> run.representation(images).shape, run.backbone_features(images).shape
        (torch.Size([5, 16]), torch.Size([5, 256]))
        >>> run.posterior(num_draws=4).draws.shape  # 4 draws of the gates of each of the 360 test images
        torch.Size([4, 360, 16])
        >>> scores = run.novelty(images, controls=False)  # fits the scorer on the training split once
        >>> scores["kl_prior"].shape, "knn_backbone" in scores
        (torch.Size([5]), True)
    """

    def __init__(self, learner: ContrastiveLearner, cfg: Config, run_dir: Path):
        self.learner, self.cfg, self.dir = learner, cfg, run_dir
        self.channels = learner.in_channels
        self.transform = eval_transform(cfg.image_size, self.channels)

    @property
    def device(self) -> torch.device:
        """The device the learner's parameters are on, where inputs are sent."""
        return next(self.learner.parameters()).device

    def gate_probs(self, images, batch_size: int = 256) -> torch.Tensor:
        """The exact inclusion probabilities q(g_k = 1 | x) of ``images`` (a BayesNCL run).

        Args:
            images: the images, in any of the forms of the module's docstring.
            batch_size: images per pass of the backbone.

        Returns:
            N x K, on the CPU.

        Raises:
            UserError: the run has no gates (``ncl`` or ``cl``).
        """
        if not self.learner.gated:
            raise UserError(f"{self.dir} is a {self.cfg.method} run: it has no gates")
        return self._apply(images, batch_size, self.learner.gate_probs)

    def representation(self, images, batch_size: int = 256) -> torch.Tensor:
        """The representation the method uses for ``images`` (``BayesNCLHead.representation``).

        Args:
            images: the images, in any of the forms of the module's docstring.
            batch_size: images per pass of the backbone.

        Returns:
            N x K, on the CPU: the gated features of a BayesNCL run (its evaluation mask), z of the others.
        """
        return self._apply(images, batch_size, self.learner.head.representation)

    def backbone_features(self, images, batch_size: int = 256) -> torch.Tensor:
        """The backbone features h of ``images``: what the linear probe reads.

        Args:
            images: the images, in any of the forms of the module's docstring.
            batch_size: images per pass of the backbone.

        Returns:
            N x D, on the CPU.
        """
        return self._apply(images, batch_size, lambda h: h)

    def posterior(self, data=None, num_draws: int = 0):
        """The gate posterior on the run's test split: :func:`~bayesncl_pyro.gate_posterior` of this run's learner.

        Args:
            data: another dataset (a ``DataSpec``) to take the test split of; by default the run's own.
            num_draws: gate draws per image from q(g | x); 0 = only the exact probabilities.

        Returns:
            A ``GatePosterior``: ``probs`` (N x K), ``features``, ``labels``, ``classes`` and, with ``num_draws``,
            ``draws`` (num_draws x N x K).
        """
        from bayesncl_pyro.evaluate.posterior import gate_posterior  # late: it loads the evaluation code

        return gate_posterior(self.learner, data, num_draws=num_draws)

    def novelty(self, images, *, controls: bool = True, batch_size: int = 256) -> dict[str, torch.Tensor]:
        """Every novelty score of ``images``: score name -> N values on the CPU, larger for an image less like training.

        The scores are ``evaluate.novelty_scores.SCORES`` (what each is, in a line): the deterministic ones (``msp_*``,
        ``energy_*``, ``knn_*``, ``mahalanobis_*`` on the backbone's features and on the representation; ``topk_*``
        for a run that selects features) for every run, the posterior's (``kl_prior``, ``gate_entropy``, ``bald``,
        ``predictive_entropy``; ``weight_mi`` and ``q_spread`` for a Bayesian gating head) for a gated one, and with
        ``controls`` the control heads' (``control_*``, trained on the frozen backbone first: about a minute on a CPU
        for the compositional recipe). The scorer is fitted once on the run's training split (its data loaded as the
        run did) and kept. Below 64 px, images must be the run's size: the scores compare them with the training
        images, and a resize would be a shift of its own.

        Args:
            images: the images, in any of the forms of the module's docstring.
            controls: with the control heads' scores.
            batch_size: images per pass of the backbone.

        Returns:
            Score name -> N values on the CPU.

        Raises:
            UserError: no images, or images below 64 px of another size than the run's.
        """
        items = list(_items(images))
        if not items:
            raise UserError("got no images: novelty scores need at least one image")
        if self.cfg.image_size < 64:
            self._check_size(items)
        h = self._apply(items, batch_size, lambda h: h)
        return self.novelty_scorer(controls)(h)

    @property
    def data(self):
        """The run's data (``DataSpec``), loaded as the run loaded it, at the first read."""
        if "_data" not in self.__dict__:
            cfg = self.cfg
            self._data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, holdout=cfg.holdout_cells)
        return self._data

    def novelty_scorer(self, controls: bool = True):
        """The run's ``novelty_scores.NoveltyScorer``, fitted on its training split at the first call, then kept.

        Args:
            controls: with the control gating heads (trained on the frozen backbone first).

        Returns:
            The scorer: called with backbone features h (N x D), it gives every score, as :meth:`novelty`.
        """
        scorers = self.__dict__.setdefault("_scorers", {})
        if controls not in scorers:
            from bayesncl_pyro.evaluate.heldout import novelty_scorer  # late: it loads the evaluation code

            scorers[controls] = novelty_scorer(self.learner, self.data, self.cfg, self.device, controls=controls)
        return scorers[controls]

    def _check_size(self, items: list):
        """Refuse images that are not ``image_size`` square (files and PIL images by their size, tensors by shape)."""
        size = self.cfg.image_size
        for item in items:
            if isinstance(item, (str, os.PathLike)):
                with Image.open(item) as image:
                    shape = image.size[::-1]
            else:
                shape = tuple(item.size[::-1]) if isinstance(item, Image.Image) else tuple(item.shape[-2:])
            if shape != (size, size):
                raise UserError(f"got a {shape[0]} x {shape[1]} image; this run's novelty scores take {size} x {size} "
                                f"images (its --image-size): the scores compare them with the training images, and a "
                                f"resize is a shift of its own; resize or crop them to {size} x {size} first")

    def inputs(self, images) -> torch.Tensor:
        """``images`` through the run's evaluation transform.

        Args:
            images: the images, in any of the forms of the module's docstring.

        Returns:
            The model's input, N x C x S x S (S: the run's image size).
        """
        return torch.stack([self.transform(self._one(image)) for image in _items(images)])

    @torch.no_grad()
    def _apply(self, images, batch_size: int, pick) -> torch.Tensor:
        """``pick`` of the backbone features h of ``images``, batch by batch, on the CPU."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise UserError(f"batch_size must be a positive number of images, got {batch_size!r}")
        self.learner.eval()
        x = self.inputs(images)
        out = [pick(self.learner.backbone(chunk.to(self.device)).float()).cpu() for chunk in x.split(batch_size)]
        return torch.cat(out)

    def _one(self, image):
        """Turn one image into what the transform takes.

        That is a PIL image of the run's mode, or a C x H x W tensor checked against the run's channels (uint8, or
        float in [0, 1]).
        """
        if isinstance(image, (str, os.PathLike)):
            image = open_image(Path(image))
        if isinstance(image, Image.Image):
            return image.convert("RGB" if self.channels == 3 else "L")
        if not torch.is_tensor(image) or image.ndim != 3 or image.shape[0] != self.channels:
            what = f"a tensor of shape {tuple(image.shape)}" if torch.is_tensor(image) else type(image).__name__
            raise UserError(f"got {what}; the run takes {self.channels}-channel images: C x H x W (or N x C x H x W) "
                            "tensors, PIL images, image files or a folder")
        if image.is_floating_point() and not ((image >= 0) & (image <= 1)).all():  # NaN fails too
            raise UserError("float images must lie in [0, 1], without NaN (the run's transform normalises them); "
                            "divide 0-255 images by 255, or pass them as uint8")
        if not image.is_floating_point() and image.dtype != torch.uint8:
            raise UserError(f"integer images must be uint8 (0-255), got {image.dtype}")
        return image.cpu()


def _items(images) -> Iterable:
    """``images`` split into single images (paths, PIL images or C x H x W tensors)."""
    if isinstance(images, (str, os.PathLike)) and Path(images).is_dir():
        paths = image_paths(images)
        if not paths:
            raise UserError(f"{images} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        return paths
    if torch.is_tensor(images) and images.ndim == 4:
        return images.unbind()
    if isinstance(images, (list, tuple)):
        if not images:
            raise UserError("got an empty list of images")
        return [one for item in images for one in _items(item)]
    return [images]

