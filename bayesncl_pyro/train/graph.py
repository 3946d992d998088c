"""The training step as one CUDA graph (``--cuda-graphs``), captured once, then replayed.

The host launches one graph a step instead of the step's hundreds of kernels (a step of small images on a fast GPU waits
for the host otherwise).

What a replay does is what the capture saw, so the step must queue the same work at every call: no host sync, no
Python value that changes from step to step inside it. The trainer keeps such things out of the captured step
(``Trainer._step``): the learning rates are tensors on the device that the schedule writes in place
(``nn.optim.build_optimizer``'s ``lr_on_device``), and the divergence guard files each step's verdict under its number
after the replay (``DivergenceGuard.keep``). Its input is copied into the graph's own tensor before each replay; its
outputs (the loss and the head's values) are the graph's tensors, rewritten by the next replay: read them before it.
"""

from collections.abc import Callable

import torch

from bayesncl_pyro.infer.head import HeadOutput

#: eager steps before the capture: the optimizer's state, the density target, lazy initialisation and cuDNN's
#: algorithm choice are made in the first steps, and a captured step must find them made
WARMUP_STEPS = 3


class StepGraph:
    """A training step run eagerly at first, then captured as a CUDA graph and replayed.

    ``step(x) -> (loss, values)`` is called ``WARMUP_STEPS`` times eagerly, then captured as a CUDA graph at the next
    call and replayed from then on. Every batch must have the shape of the first captured one.
    """

    def __init__(self, step: Callable[[torch.Tensor], tuple[torch.Tensor, HeadOutput]]):
        self.step, self.eager_left = step, WARMUP_STEPS
        self.graph: torch.cuda.CUDAGraph | None = None
        self.input: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.values: HeadOutput | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
        """Run one step on ``x``: eagerly, by capturing the graph, or by replaying it."""
        if self.eager_left:
            self.eager_left -= 1
            return self.step(x)
        if self.graph is None:
            self.input = x.clone()
            self.graph = torch.cuda.CUDAGraph()
            # records the step's kernels (none of them runs yet); thread_local: the input pipeline's thread goes on
            # allocating and waiting for its own stream meanwhile, which "global" would refuse. Whatever any thread
            # queues on the capturing stream is captured, so it is a high-priority stream: the pool the input
            # pipeline's and the decoders' streams are drawn from (priority 0) cannot hand it to them
            capture = torch.cuda.Stream(x.device, priority=-1)
            with torch.cuda.graph(self.graph, stream=capture, capture_error_mode="thread_local"):
                self.loss, self.values = self.step(self.input)
        else:
            if x.shape != self.input.shape:
                raise RuntimeError(f"a batch of shape {tuple(x.shape)} for the CUDA graph captured at "
                                   f"{tuple(self.input.shape)}: every batch of a --cuda-graphs run has the same size")
            self.input.copy_(x)
        self.graph.replay()
        return self.loss, self.values.unread()
