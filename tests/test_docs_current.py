"""The README and docs/RESULTS.md say what the code does today."""

import json
import re
from pathlib import Path

import pytest

from bayesncl_pyro.evaluate import verdict

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "RESULTS.md").read_text()


def test_the_layout_lists_every_notebook():
    layout = README.split("\n## Layout\n")[1].split("\n## ")[0]
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) > 1 and all(name in layout for name in notebooks)


def test_the_first_runs_time_is_given_with_its_date_where_the_figures_differ():
    times = set(re.findall(r"(\d+ min \d+ s) on 2 idle CPU cores", README))
    assert len(times) == 1  # one figure in the README
    default_run = RESULTS.split("### The default first run")[1].split("\n### ")[0]
    assert times.pop() in default_run and "prints the same numbers" not in RESULTS


def test_the_svi_step_s_loss_scale_is_said():
    own_code = (ROOT / "docs" / "own_code.md").read_text()  # the head in your own loop, in detail: the site's page
    assert "2N times the head's loss per row" in own_code and "277,000" in own_code


def test_the_readme_shows_the_spread_of_the_first_run_not_one_draw():
    """Item 1: the README's first-run figures beside the ten seeds' spread and another thread count."""
    setup = README.split("\n## Set-up: two commands\n")[1].split("\n## ")[0]
    summary = json.loads(verdict.SUMMARY.read_text())
    d = summary["gates_minus_posthoc_topn"]
    assert f"[95 % interval {d['low']:+.3f}, {d['high']:+.3f}]" in setup
    assert "OMP_NUM_THREADS=1" in setup and "OMP_NUM_THREADS=2" in setup
    c = summary["semantic_consistency"]
    assert f"{c['mean']:.3f} ± {c['sd']:.3f}" in setup


def test_the_readme_is_a_landing_page_under_250_lines():
    """What it leaves out lives on the site's pages (docs/), which the README links."""
    assert len(README.splitlines()) < 250


def test_the_fixed_rate_prior_on_the_own_code_page_builds_a_head():
    import torch

    from bayesncl_pyro import BayesNCLHead

    page = (ROOT / "docs" / "own_code.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", page, re.S) if "class HalfOpen" in c]
    namespace: dict = {}
    exec(compile(code, "docs/own_code.md", "exec"), namespace)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior=namespace["HalfOpen"](8, 0.8, scale=0.25))
    torch.testing.assert_close(head.model.prior.rate(), torch.tensor([0.8] * 4 + [0.2] * 4))


def test_the_per_row_correlated_prior_on_the_own_code_page_trains():
    """A factor per image moves its gates together: the head builds with its amortised guide, and a step trains that
    guide; the same prior without make_guide is refused in one line asking for one."""
    import torch

    from bayesncl_pyro import BayesNCLHead
    from bayesncl_pyro.errors import UserError

    page = (ROOT / "docs" / "own_code.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", page, re.S) if "class RowFactor" in c]
    namespace: dict = {}
    exec(compile(code, "docs/own_code.md", "exec"), namespace)
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior=namespace["RowFactor"](8, 0.3), kl_weight=0.1)
    assert head.kl_kind == {"z": "analytic", "g": "analytic"}
    loss, out = head(torch.randn(10, 6))
    loss.backward()
    assert torch.isfinite(loss) and head.guide.rate_guide.v.grad.abs().sum() > 0
    rates = out.prior.base_dist.probs
    torch.testing.assert_close(rates[:5], rates[5:])  # an image's two views share its factor
    assert not torch.allclose(rates[0], rates[1])  # and images differ

    class NoGuide(namespace["RowFactor"]):
        make_guide = namespace["Prior"].make_guide

    with pytest.raises(UserError, match="NoGuide has row_latents, latents per image, whose guide must be amortised"):
        BayesNCLHead(6, 8, 16, num_train=100, prior=NoGuide(8, 0.3))
