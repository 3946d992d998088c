"""The lambda record's declared secondary question: each lambda minus lambda 3e-5, same seed (docs/RESULTS.md).

kl_prior's AUROC on new shapes and the top-N consistency; 95 % t intervals (evaluate.stats.interval), Holm over the
six differences; then LP@1, not declared, Holm over its three rows alone. Reads the record's eval.json files;
writes secondary.md beside them. From the checkout's root:

    python docs/results/lambda-d0.3/secondary.py
"""
import json
import sys
from pathlib import Path

from bayesncl_pyro.evaluate.stats import holm, interval, mean_sd

rec = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/lambda-d0.3")
runs = {}
for ev in sorted(rec.glob("bayesncl-ste-lambda*-seed*/eval.json")):
    name = ev.parent.name
    lam, seed = name.split("lambda")[1].split("-d0.3-seed")
    runs[(lam, int(seed))] = json.loads(ev.read_text())
kl = lambda e: e["novelty"]["sets"]["new-shapes"]["scores"]["kl_prior"]["auroc"]  # noqa: E731
DECLARED = {"kl_prior AUROC, new shapes": kl, "top-N consistency": lambda e: e["semantic_consistency_topn"]}
AFTER = {"LP@1": lambda e: e["linear_probe_top1"]}  # not declared: the runs' collapse made it worth a look
lams = sorted({lam for lam, _ in runs if lam != "3e-05"}, key=float)
base = [runs[("3e-05", s)] for s in sorted(s for l_, s in runs if l_ == "3e-05")]


def table(measures: dict) -> list[str]:
    """Each lambda minus lambda 3e-5 on ``measures``, same seed, with Holm over the table's rows."""
    rows = []
    for lam in lams:
        seeds = sorted(s for l_, s in runs if l_ == lam and ("3e-05", s) in runs)
        for what, f in measures.items():
            d = [f(runs[(lam, s)]) - f(runs[("3e-05", s)]) for s in seeds]
            rows.append(dict(lam=lam, what=what, seeds=seeds, **interval(d)))
    for r, p in zip(rows, holm([r["p"] for r in rows])):
        r["p_holm"] = p
    out = ["| lambda | measure | seeds | value at lambda (mean ± sd) | minus lambda 3e-5 [95 % t] | p | Holm p | MDD |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, sd = mean_sd([measures[r["what"]](runs[(r["lam"], s)]) for s in r["seeds"]])
        out.append(f"| {r['lam']} | {r['what']} | {len(r['seeds'])} | {m:.3f} ± {sd:.3f} | {r['mean']:+.3f} "
                   f"[{r['t_low']:+.3f}, {r['t_high']:+.3f}] | {r['p']:.3f} | {r['p_holm']:.3f} | {r['mdd']:.3f} |")
    for what, f in measures.items():
        m, sd = mean_sd([f(e) for e in base])
        out.append(f"| 3e-05 | {what} | {len(base)} | {m:.3f} ± {sd:.3f} | | | | |")
    return out


text = "\n".join(["The declared secondary rows (Holm over these six):", "", *table(DECLARED), "",
                  "Not declared (read after the runs; Holm over these three alone):", "", *table(AFTER)]) + "\n"
(rec / "secondary.md").write_text(text)
print(text)
