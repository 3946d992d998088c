"""Where the Pyro layer's time goes in a BayesNCL training step on the CPU.

The head's Pyro program (its handlers, the ELBO's sum over its traces, the head's own work around them) against the same
maths written in plain PyTorch, part by part, and the divergence guard's per-step norms.

    python experiments/bench_pyro_parts.py                        # the digits recipe
    python experiments/bench_pyro_parts.py --dataset cifar10 --encoder cnn

The Pyro layer's cost is host work (Python, and one dispatch per tensor op): it does not grow with the tensors. So the
parts are timed on a head of the recipe's kind (its gate estimator and prior, the learner's settings) with tiny tensors
(8 rows, 4 gates, 8 features), where the arithmetic costs next to nothing, then set against a step of the recipe
(``bench_step.py``'s bayesncl variant: forward, backward, SGD). Everything is CPU time of this thread on one thread, the
median over ``--repeats`` interleaved rounds: other processes on a shared machine do not count, though their contention
for caches still slows this one. Forward only unless named; each part is the Pyro path's time minus its plain
counterpart's:

  guide's handlers      the guide traced, its estimator applied (``poutine.reparam``), scaled and in its plate, minus
                        its tensor work (q(g | x) and the estimator's gate values)
  model's handlers      the model traced and replayed against the guide's trace, minus its tensor work (features,
                        the prior, gating, InfoNCE)
  ELBO's sum            ``MeanFieldELBO`` over the two traces (each site's KL or factor, scaled), minus the plain sum
  head's bookkeeping    ``elbo_terms`` less the above: the prior-gradient hooks' check, the param-store scope, the
                        program's handlers built, the loss's scaling
  forward's values      ``forward`` less ``elbo_terms``: the monitoring values, the gates' retained gradient
  backward              what the Pyro path's backward pass costs over the plain one's
"""

import argparse
import dataclasses
import statistics
import sys
import time

import pyro
import torch
from pyro import poutine

from bayesncl_pyro.config import Config
from bayesncl_pyro.infer.head import BayesNCLHead, own_params
from bayesncl_pyro.infer.learner import ContrastiveLearner, head_arguments
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.train.resolve import resolve

ROWS, FEATURES = 8, 8


def cpu_time(fn, calls: int, backward: bool = False) -> float:
    """Seconds of this thread's CPU time per call of ``fn`` (and the backward pass of what it returns)."""
    tic = time.thread_time()
    for _ in range(calls):
        out = fn()
        if backward:
            out.backward()
    return (time.thread_time() - tic) / calls


def head_parts(cfg: Config) -> dict:
    """Name -> (function of no arguments, with its backward pass?): the parts of a tiny head of the recipe's kind."""
    head = BayesNCLHead(FEATURES, num_train=50_000, gather_distributed=True,
                        **head_arguments(dataclasses.replace(cfg, proj_dim=4, proj_hidden=8)))
    model, guide, estimator = head.model, head.guide, head.estimator
    h = torch.randn(ROWS, FEATURES)
    z = head.projector(h).detach().requires_grad_()
    program, program_guide = head.training_program(gather=None)
    with own_params():
        guide_trace = poutine.trace(program_guide).get_trace(z, h)
        model_trace = poutine.trace(poutine.replay(program, trace=guide_trace)).get_trace(z, h)
    g = model_trace.nodes["g"]["value"]
    elbo = estimator.elbo()

    def plain():  # bench_step.plain_loss's head
        q = guide.posterior(h)
        u = normalize(model.features(head.projector(h)) * estimator.value(q))
        kl = bernoulli_kl(estimator.kl_probs(q), model.prior.rate(), estimator.kl_clamp).sum(1).mean()
        return info_nce_rows(u, model.temperature).mean() + model.kl_weight * kl

    def traced(fn):
        def run():
            with own_params():
                return fn()
        return run

    def plain_sum():
        q = guide_trace.nodes["g"]["fn"].base_dist
        kl = bernoulli_kl(estimator.kl_probs(q), model.prior.rate(), estimator.kl_clamp).sum(1).mean()
        return model_trace.nodes["nce"]["fn"].log_factor + model.kl_weight * kl

    return {
        "plain": plain,
        "pyro": lambda: head(h)[0],
        "elbo_terms": lambda: head.elbo_terms(head.projector(h), h).loss,
        "projector": lambda: head.projector(h),
        "guide traced": traced(lambda: poutine.trace(program_guide).get_trace(z, h)),
        "guide's tensors": lambda: estimator.value(guide.posterior(h)),
        "model traced": traced(lambda: poutine.trace(poutine.replay(program, trace=guide_trace)).get_trace(z, h)),
        "model's tensors": lambda: (model.prior.rate(), info_nce_rows(normalize(model.features(z) * g),
                                                                      model.temperature)),
        "ELBO's sum": lambda: elbo._differentiable_loss_particle(model_trace, guide_trace),
        "plain sum": plain_sum,
    }


def main(argv=None) -> int:
    """Time each part of the Pyro layer against its plain-PyTorch counterpart and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits", help="the recipe (default: %(default)s)")
    p.add_argument("--encoder", help="default: the dataset's")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--calls", type=int, default=200, help="calls of each part per round (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="steps of the recipe per round (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = resolve(Config(dataset=args.dataset, encoder=args.encoder, method="bayesncl", device="cpu"))
    torch.manual_seed(0)
    parts = head_parts(cfg)
    learner = ContrastiveLearner(cfg, 1 if cfg.dataset == "digits" else 3, 50_000).train()
    x = torch.randn(2 * cfg.batch_size, learner.in_channels, cfg.image_size, cfg.image_size)
    optimizer = torch.optim.SGD(learner.parameters(), lr=1e-3)

    def step():
        loss = learner(x)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    timed = {**{name: (fn, False) for name, fn in parts.items()}, "plain, with backward": (parts["plain"], True),
             "pyro, with backward": (parts["pyro"], True), "step": (step, False)}
    calls = {"step": args.steps}
    with pyro.validation_enabled(False):
        step()
        grads = [p.grad for p in learner.parameters() if p.grad is not None]  # as DivergenceGuard.judge norms them
        timed["guard's norms"] = (lambda: torch._foreach_norm(grads, 2, dtype=torch.float64), False)
        for fn, backward in timed.values():
            cpu_time(fn, 3, backward)
        times = {name: [] for name in timed}
        for _ in range(args.repeats):
            for name, (fn, backward) in timed.items():
                times[name].append(cpu_time(fn, calls.get(name, args.calls), backward))
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    rows = [
        ("guide's handlers", us["guide traced"] - us["guide's tensors"]),
        ("model's handlers", us["model traced"] - us["model's tensors"]),
        ("ELBO's sum", us["ELBO's sum"] - us["plain sum"]),
        ("head's bookkeeping",
         us["elbo_terms"] - us["projector"] - us["guide traced"] - us["model traced"] - us["ELBO's sum"]),
        ("forward's values", us["pyro"] - us["elbo_terms"]),
        ("backward", (us["pyro, with backward"] - us["plain, with backward"]) - (us["pyro"] - us["plain"])),
    ]
    total = us["pyro, with backward"] - us["plain, with backward"]
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, CPU, 1 thread; {cfg.dataset} recipe ({cfg.encoder}, "
          f"batch {cfg.batch_size}, K={cfg.proj_dim}, gate {cfg.gate}, prior {cfg.prior}); CPU time, median of "
          f"{args.repeats} rounds")
    print(f"\nhead, forward and backward: plain {us['plain, with backward']:.0f} us, Pyro "
          f"{us['pyro, with backward']:.0f} us; the Pyro layer {total:.0f} us a step")
    print(f"{'part':22} {'us a step':>9} {'share of a step':>16}")
    for name, cost in rows:
        print(f"{name:22} {cost:9.0f} {100 * cost / us['step']:15.2f}%")
    print(f"{'(the parts summed)':22} {sum(c for _, c in rows):9.0f}")
    print(f"\na {cfg.dataset} step (forward, backward, SGD): {us['step'] / 1e3:.1f} ms; the Pyro layer "
          f"{100 * total / us['step']:.2f}% of it")
    norms = us["guard's norms"]
    print(f"the divergence guard's float64 norms of the {len(grads)} gradients (the trainer's, every step; not in "
          f"bench_step's variants): {norms:.0f} us, {100 * norms / us['step']:.2f}% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
