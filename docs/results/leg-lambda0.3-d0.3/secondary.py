"""This record's exploratory rows (docs/RESULTS.md): leg at lambda 3e-1, D 0.3, against two same-seed baselines.

LP@1 minus STE's at lambda 3e-1 (docs/results/lambda-d0.3), and kl_prior's AUROC on new shapes minus leg's at lambda
3e-2 (docs/results/leg-lambda0.03-d0.3); 95 % t intervals (evaluate.stats.interval), Holm over the two. Writes
secondary.md beside the records. From the checkout's root:

    python docs/results/leg-lambda0.3-d0.3/secondary.py
"""
import json
from pathlib import Path

from bayesncl_pyro.evaluate.stats import holm, interval, mean_sd

results = Path("docs/results")
here = results / "leg-lambda0.3-d0.3"


def evals(folder: Path, run: str) -> list[dict]:
    """Seeds 0-4's eval.json of one run name (``{s}`` for the seed)."""
    return [json.loads((folder / run.format(s=s) / "eval.json").read_text()) for s in range(5)]


leg = evals(here, "bayesncl-leg-d0.3-seed{s}")
ROWS = [("LP@1", "STE, lambda 3e-1", lambda e: e["linear_probe_top1"],
         evals(results / "lambda-d0.3", "bayesncl-ste-lambda0.3-d0.3-seed{s}")),
        ("kl_prior AUROC, new shapes", "leg, lambda 3e-2",
         lambda e: e["novelty"]["sets"]["new-shapes"]["scores"]["kl_prior"]["auroc"],
         evals(results / "leg-lambda0.03-d0.3", "bayesncl-leg-d0.3-seed{s}"))]

diffs = [interval([f(a) - f(b) for a, b in zip(leg, base)]) for _, _, f, base in ROWS]
out = ["The declared exploratory rows (same seed; Holm over these two):", "",
       "| measure | leg, lambda 3e-1 (mean ± sd) | against | its mean ± sd | difference [95 % t] | p | Holm p |",
       "|---|---|---|---|---|---|---|"]
for (what, against, f, base), d, p_holm in zip(ROWS, diffs, holm([d["p"] for d in diffs])):
    (a, sa), (b, sb) = mean_sd([f(e) for e in leg]), mean_sd([f(e) for e in base])
    out.append(f"| {what} | {a:.3f} ± {sa:.3f} | {against} | {b:.3f} ± {sb:.3f} | {d['mean']:+.3f} "
               f"[{d['t_low']:+.3f}, {d['t_high']:+.3f}] | {d['p']:.3f} | {p_holm:.3f} |")
text = "\n".join(out) + "\n"
(here / "secondary.md").write_text(text)
print(text)
