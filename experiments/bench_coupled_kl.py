"""What the gates' KL costs for a prior that couples a row's gates, against the analytic KL of independent gates.

A coupled prior's KL is the local expectation estimate (``bayesncl_pyro/infer/kl.py``): per gate, log p with that
gate on and off at the other gates' draw, K + 1 evaluations of the prior's log-density per row if done one flip at a
time. For a mixture of Bernoulli products (a mixture of sparsity regimes, ``MixtureSameFamily``) all K flips come in
one pass from the components' log-densities and logits; any other law, through its ``log_prob`` on the K flipped
copies, in chunks. A law may give its flips itself (``flip_log_probs``) where its structure makes them cheap: here a
Markov chain of the gates, each gate's logit moved by the one before it, where flipping gate j changes two terms:
rows x K work, where K evaluations of its log-density cost rows x K^2. (A dense autoregressive law, each logit linear
in every gate before it, has no such saving: each flip moves every later logit, so its K flips cost K log-densities
however they are batched.) Printed: each
way's forward-and-backward time per call as a ratio to the analytic Bernoulli KL's on the same rows and gates,
measured in one run, on this thread.

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


class MarkovGates(torch.distributions.Distribution):
    """Gates as a Markov chain, gate k Bernoulli(sigmoid(bias_k + weight_k g_{k-1})): neighbouring gates coupled.

    Its log-density is sum_k g_k l_k - softplus(l_k), with l_k = bias_k + weight_k g_{k-1} (g_{-1} = 0).
    """

    arg_constraints = {}

    def __init__(self, bias: torch.Tensor, weight: torch.Tensor, rows: int):
        self.bias, self.weight = bias, weight
        super().__init__(torch.Size([rows]), torch.Size([bias.shape[-1]]), validate_args=False)

    def _logits(self, value):
        previous = torch.nn.functional.pad(value[..., :-1], (1, 0))
        return self.bias + self.weight * previous

    def log_prob(self, value):
        """sum_k g_k l_k - softplus(l_k) per row."""
        logits = self._logits(value)
        return (value * logits - torch.nn.functional.softplus(logits)).sum(-1)

    def flip_log_probs(self, b):
        """Log p(b with gate j flipped) for every j, K x rows.

        Flipping j (by s_j = 1 - 2 b_j) changes its own term by s_j l_j and moves the next gate's logit by
        s_j weight_{j+1}: rows x K work.
        """
        logits, sign = self._logits(b), 1 - 2 * b
        moved = logits[..., 1:] + sign[..., :-1] * self.weight[1:]
        following = (b[..., 1:] * (moved - logits[..., 1:]) - torch.nn.functional.softplus(moved)
                     + torch.nn.functional.softplus(logits[..., 1:]))
        change = sign * logits + torch.nn.functional.pad(following, (0, 1))
        return (self.log_prob(b).unsqueeze(-1) + change).movedim(-1, 0)


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
    chain = MarkovGates(torch.randn(k) - 1, 2 * torch.randn(k), rows)
    torch.testing.assert_close(_flipped_log_probs(chain, b), _flipped_log_probs(_Opaque(chain), b))
    for name, p in (("mixture, batched flips", mixture), ("mixture behind a bare log_prob", _Opaque(mixture)),
                    ("Markov chain, its own flips", chain), ("Markov chain behind a bare log_prob", _Opaque(chain))):
        t = _time(step(p), args.repeats)
        print(f"{name}: {t * 1e3:.1f} ms, {t / analytic:.1f}x the analytic KL")


if __name__ == "__main__":
    main()
