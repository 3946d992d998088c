"""This record's exploratory rows (docs/RESULTS.md): leg minus STE at lambda 3e-2, D 0.3, same seed.

STE's runs are docs/results/lambda-d0.3's. kl_prior's AUROC on new shapes and the test split's open share; 95 % t
intervals (evaluate.stats.interval), Holm over the two; then LP@1, not declared. Writes secondary.md beside the
records. From the checkout's root:

    python docs/results/leg-lambda0.03-d0.3/secondary.py
"""
import json
from pathlib import Path

from bayesncl_pyro.evaluate.stats import holm, interval, mean_sd

here, ste = Path("docs/results/leg-lambda0.03-d0.3"), Path("docs/results/lambda-d0.3")
pairs = [(json.loads((here / f"bayesncl-leg-d0.3-seed{s}/eval.json").read_text()),
          json.loads((ste / f"bayesncl-ste-lambda0.03-d0.3-seed{s}/eval.json").read_text())) for s in range(5)]
DECLARED = {"kl_prior AUROC, new shapes": lambda e: e["novelty"]["sets"]["new-shapes"]["scores"]["kl_prior"]["auroc"],
            "open share (test)": lambda e: e["gates_open"]}
AFTER = {"LP@1": lambda e: e["linear_probe_top1"]}  # not declared: read after the runs


def table(measures: dict) -> list[str]:
    """The leg runs minus STE's on ``measures``, same seed, with Holm over the table's rows."""
    rows = {what: interval([f(leg) - f(s) for leg, s in pairs]) for what, f in measures.items()}
    for row, p in zip(rows.values(), holm([r["p"] for r in rows.values()])):
        row["p_holm"] = p
    out = ["| measure | leg (mean ± sd) | STE (mean ± sd) | leg minus STE [95 % t] | p | Holm p |",
           "|---|---|---|---|---|---|"]
    for what, f in measures.items():
        (a, sa), (b, sb), r = mean_sd([f(x) for x, _ in pairs]), mean_sd([f(y) for _, y in pairs]), rows[what]
        out.append(f"| {what} | {a:.3f} ± {sa:.3f} | {b:.3f} ± {sb:.3f} | {r['mean']:+.3f} [{r['t_low']:+.3f}, "
                   f"{r['t_high']:+.3f}] | {r['p']:.3f} | {r['p_holm']:.3f} |")
    return out


text = "\n".join(["The declared exploratory rows (Holm over these two):", "", *table(DECLARED), "",
                  "Not declared (read after the runs):", "", *table(AFTER)]) + "\n"
(here / "secondary.md").write_text(text)
print(text)
