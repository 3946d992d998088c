"""BayesNCL's gates on a torchvision backbone, trained in a plain PyTorch loop.

    python examples/train_your_backbone.py --steps 200 --batch-size 128   # ResNet-18 (on a GPU if there is one)

BayesNCLHead takes the backbone's features of both views of a batch, [view 1; view 2], and returns the loss
(InfoNCE + lambda * KL per row) and monitoring values; it holds all of the method: the loop brings the backbone.
"""

import argparse

import pyro
import torch
import torchvision
from torch.utils.data import DataLoader

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.views import TwoViews, eval_transform, simclr_transform

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=128)
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
pyro.enable_validation(False)  # on by default: Pyro's checks of the program at every step, not needed for the loss

data = load_dataset("compositional")  # 32 px shapes on backgrounds that every class shares; no download
loader = DataLoader(TwoViews(data.train, simclr_transform(32)), batch_size=args.batch_size, shuffle=True,
                    drop_last=True)  # items: (view 1, view 2, label, index)

backbone = torchvision.models.resnet18()  # any nn.Module that maps images to N x D features
backbone.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)  # a stem for 32 px images
backbone.maxpool, backbone.fc = torch.nn.Identity(), torch.nn.Identity()  # features: N x 512
head = BayesNCLHead(512, proj_dim=64, proj_hidden=512, num_train=len(data.train), prior="bernoulli", gate="ste")
backbone, head = backbone.to(device), head.to(device)
optimizer = torch.optim.SGD(head.param_groups(lr=0.06, gate_lr=0.1, backbone=backbone), lr=0.06, momentum=0.9,
                            weight_decay=1e-4)
step = 0
while step < args.steps:
    for v1, v2, _, _ in loader:
        loss, stats = head(backbone(torch.cat([v1, v2]).to(device)))  # rows [view 1; view 2]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        head.update_density(stats)  # with gate_density, the constraint's multiplier; without, nothing
        step += 1
        if step % 20 == 0 or step == args.steps:
            pulls = head.pulls(stats)  # read after backward: how hard InfoNCE and the prior move the gates
            print(f"step {step}: loss {loss.item():.4f}, InfoNCE {stats.nce.item():.4f}, KL "
                  f"{stats.kl.item():.2f}, mean P(on) {stats.gate_rate.item():.0%}, pulls "
                  f"{pulls['gate_nce_pull']:.2g} (InfoNCE) {pulls['gate_prior_pull']:.2g} (prior)")
        if step == args.steps:
            break

backbone.eval()  # the gates of test images: q(g_k = 1 | x) from their backbone features
with torch.no_grad():
    x = torch.stack([eval_transform(32)(data.test[i][0]) for i in range(256)]).to(device)
    probs = head.gate_probs(backbone(x))
print(f"test images: {probs.mean():.0%} of the gates open; {(probs.mean(0) > 0.5).sum()} of 64 dims open for most")
