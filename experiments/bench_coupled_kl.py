"""What the gates' KL costs for a prior that couples a row's gates, against the analytic KL of independent gates.

A coupled prior's KL is the local expectation estimate (``bayesncl_pyro/infer/kl.py``): per gate, log p with that
gate on and off at the other gates' draw, K + 1 evaluations of the prior's log-density per row if done one flip at a
time. For a mixture of Bernoulli products (a mixture of sparsity regimes, ``MixtureSameFamily``) all K flips come in
one pass from the components' log-densities and logits; any other law, through its ``log_prob`` on the K flipped
copies, in chunks. Printed: each way's forward-and-backward time per call as a ratio to the analytic Bernoulli KL's
on the same rows and gates, measured in one run, on this thread.

    python experiments/bench_coupled_kl.py                 # K 256, 512 rows, 2 regimes
    python experiments/bench_coupled_kl.py --features 64 --rows 128 --regimes 4
"""

import argparse
import statistics
import time

import torch
from torch.distributions import Bernoulli, Categorical, Independent, MixtureSameFamily

from bayesncl_pyro.infer.kl import _flipped_log_probs, site_kl


class _Opaque(torch.distributions.Distribution):
    """The same mixture behind a bare ``log_prob``: what a law without a fast path costs."""

    arg_constraints = {}

    def __init__(self, p):
        self.p = p
        super().__init__(p.batch_shape, p.event_shape, validate_args=False)

    def log_prob(self, value):
        return self.p.log_prob(value)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    """Time the three KLs on one thread and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--regimes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    k, rows = args.features, args.rows
    logits = torch.randn(rows, k, requires_grad=True)
    probs = logits.sigmoid()
    q = Independent(Bernoulli(probs=probs), 1)
    rates = torch.linspace(0.1, 0.7, args.regimes).unsqueeze(-1).expand(args.regimes, k)
    mixture = MixtureSameFamily(Categorical(torch.ones(args.regimes)), Independent(Bernoulli(probs=rates), 1))
    mixture = mixture.expand([rows])
    bernoulli = Independent(Bernoulli(probs=torch.full((rows, k), 0.3)), 1)

    def step(p):
        def run():
            kl, _ = site_kl(q, p, None, kl_clamp=None)
            torch.autograd.grad(kl.sum(), logits, retain_graph=True)
        return run

    b = torch.bernoulli(probs.detach())
    # the fast path and the generic one give the same flips
    torch.testing.assert_close(_flipped_log_probs(mixture, b), _flipped_log_probs(_Opaque(mixture), b))
    analytic = _time(step(bernoulli), args.repeats)
    print(f"K {k}, {rows} rows, {args.regimes} regimes, {torch.get_num_threads()} threads; "
          f"analytic Bernoulli KL: {analytic * 1e3:.2f} ms per call (forward and backward)")
    for name, p in (("mixture, batched flips", mixture), ("mixture behind a bare log_prob", _Opaque(mixture))):
        t = _time(step(p), args.repeats)
        print(f"{name}: {t * 1e3:.1f} ms, {t / analytic:.1f}x the analytic KL")


if __name__ == "__main__":
    main()
