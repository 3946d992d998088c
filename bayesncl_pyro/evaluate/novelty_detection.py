"""One run's novelty evaluation: how well each novelty score separates a novel set from the test split.

Each score (``novelty_scores``) is judged on each novel set against the in-distribution test split (:func:`detection`:
AUROC, FPR at 95 % TPR and AUPR with the novel images positive, by ``pytorch_ood.metrics.OODMetrics``); :func:`report`
is eval.json's ``novelty``.
"""

import math

import torch

from bayesncl_pyro.evaluate.novelty_scores import DRAWS, SCORES


def detection(in_scores: dict[str, torch.Tensor], novel_scores: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per score, how well it separates a novel set (positive) from the in-distribution images.

    ``auroc``, ``fpr95`` (the share of in-distribution images flagged at the threshold that flags 95 % of the novel
    ones), ``aupr`` (novel images positive: AUPR-OUT) by ``pytorch_ood.metrics.OODMetrics``; and ``flagged``, the share
    of the novel set above the in-distribution split's 95th percentile (a nuisance set's false-alarm rate there, about
    0.05 for a score blind to the shift).
    """
    from pytorch_ood.metrics import OODMetrics  # late: only an evaluation needs it

    out = {}
    for name, novel in novel_scores.items():
        known = in_scores[name]
        scores = torch.cat([known, novel]).double()
        labels = torch.cat([torch.zeros(len(known)), -torch.ones(len(novel))]).long()
        if not torch.isfinite(scores).all():
            out[name] = dict(auroc=math.nan, fpr95=math.nan, aupr=math.nan, flagged=math.nan)
            continue
        metrics = OODMetrics()
        metrics.update(scores, labels)
        m = metrics.compute()
        threshold = torch.quantile(known.double(), 0.95)
        out[name] = dict(auroc=float(m["AUROC"]), fpr95=float(m["FPR95TPR"]), aupr=float(m["AUPR-OUT"]),
                         flagged=float((novel > threshold).double().mean()))
    return out


def report(in_scores: dict[str, torch.Tensor], novel: dict[str, dict[str, torch.Tensor]],
           kinds: dict[str, str]) -> dict:
    """eval.json's ``novelty``: per novel set its kind, size and each score's :func:`detection`.

    With at least one semantic and one nuisance set, also ``full_spectrum``: the semantic sets against the
    in-distribution split and the nuisance sets together (OpenOOD v1.5's full-spectrum setting, where a nuisance
    shift counts as known).
    """
    sets = {name: dict(kind=kinds.get(name, "semantic"), n=len(next(iter(scores.values()))),
                       scores=detection(in_scores, scores)) for name, scores in novel.items()}
    out = dict(sets=sets, draws=DRAWS, definitions={k: SCORES[k] for k in in_scores})
    semantic = [n for n in novel if kinds.get(n) == "semantic"]
    nuisance = [n for n in novel if kinds.get(n) == "nuisance"]
    if semantic and nuisance:
        known = {k: torch.cat([in_scores[k]] + [novel[n][k] for n in nuisance]) for k in in_scores}
        positive = {k: torch.cat([novel[n][k] for n in semantic]) for k in in_scores}
        out["full_spectrum"] = dict(semantic=semantic, nuisance=nuisance, scores=detection(known, positive))
    return out
