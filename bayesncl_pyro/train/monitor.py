"""Online monitoring during training (``--monitor-every``).

How the representation comes along, every few epochs, at a small cost (README.md's table of run files gives it, under
``log.jsonl``).

On a subset of the data drawn once from the run's seed (``BANK`` training images, ``QUERIES`` test images), in eval
mode: ``knn_top1``, the weighted kNN top-1 of the test images' backbone features against the training images' (as
``eval.json``'s ``knn_top1``, on the subset), and ``rankme``, the RankMe of the representation the method uses on
all of them (``metrics.rankme``). Monitoring reads no random stream of the run and leaves the learner as it was, so
a run's numbers do not depend on it.
"""

import torch
from torch.utils.data import Subset

from bayesncl_pyro.config import Config
from bayesncl_pyro.evaluate.heldout import extract
from bayesncl_pyro.evaluate.metrics import rankme
from bayesncl_pyro.evaluate.probe import knn_top1

BANK = 1024
QUERIES = 256


class Monitor:
    """``Monitor(learner, data, cfg, device)()`` -> ``{"knn_top1": fraction, "rankme": in [1, K]}``."""

    def __init__(self, learner, data, cfg: Config, device: torch.device):
        self.learner, self.cfg, self.device, self.channels = learner, cfg, device, data.channels
        generator = torch.Generator().manual_seed(cfg.seed)
        self.bank = Subset(data.train, torch.randperm(len(data.train), generator=generator)[:BANK].tolist())
        self.queries = Subset(data.test, torch.randperm(len(data.test), generator=generator)[:QUERIES].tolist())

    def __call__(self) -> dict:
        """One monitoring record: ``knn_top1`` and ``rankme`` on the subset."""
        training = self.learner.training
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # a loader's iterator draws its seed from the global stream
            h_bank, f_bank, y_bank = extract(self.learner, self.bank, self.cfg, self.channels, self.device)
            h_query, f_query, y_query = extract(self.learner, self.queries, self.cfg, self.channels, self.device)
        self.learner.train(training)
        return dict(knn_top1=knn_top1(h_bank, y_bank, h_query, y_query),
                    rankme=rankme(torch.cat([f_bank, f_query])))
