"""--encoder: the project's registry, torchvision names, timm:NAME and package.module:callable, with the feature
width measured, the CIFAR stem where the reference uses one, and a checkpoint that rebuilds its backbone."""

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.nn import encoders
from bayesncl_pyro.nn.encoders import ENCODERS, build_backbone
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer


class TinyNet(nn.Module):
    """A user's backbone, imported by spec (``test_encoders:TinyNet``: pytest puts tests/ on sys.path)."""

    def __init__(self, in_channels: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 6, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


def feature_map(in_channels: int, image_size: int):
    return nn.Conv2d(in_channels, 4, 3)  # forgets to pool


def test_the_reference_resnet18_gets_the_cifar_stem_below_64_px_only():
    small, width = build_backbone("resnet18", 3, 32)
    assert width == 512
    assert (small.conv1.kernel_size, small.conv1.stride, small.conv1.padding) == ((3, 3), (1, 1), (2, 2))
    assert isinstance(small.maxpool, nn.Identity) and isinstance(small.fc, nn.Identity)
    large, _ = build_backbone("resnet18", 1, 64)
    assert (large.conv1.in_channels, large.conv1.kernel_size, large.conv1.stride) == (1, (7, 7), (2, 2))
    assert isinstance(large.maxpool, nn.MaxPool2d)
    # another torchvision ResNet by name, on the same path
    deep, width = build_backbone("resnet50", 3, 32)
    assert width == 2048 and deep.conv1.kernel_size == (3, 3) and isinstance(deep.maxpool, nn.Identity)


@pytest.mark.parametrize("spec, channels, width", [("mobilenet_v3_small", 3, 1024), ("vit_b_16", 3, 768),
                                                   ("convnext_tiny", 1, 768)])
def test_torchvision_models_by_name_lose_their_classifier(spec, channels, width):
    net, measured = build_backbone(spec, channels, 32)
    assert measured == width
    net.train()
    assert net(torch.rand(2, channels, 32, 32)).shape == (2, width)  # in training mode too (BatchNorm, dropout)


def test_timm_models_by_name():
    pytest.importorskip("timm", reason="timm is an optional extra: pip install -e '.[timm]'")
    net, width = build_backbone("timm:test_vit", 3, 32)
    assert net(torch.rand(2, 3, 32, 32)).shape == (2, width)
    _, width = build_backbone("timm:test_resnet", 1, 32)
    assert width == 96
    with pytest.raises(UserError, match="timm has no model 'no_such_net'"):
        build_backbone("timm:no_such_net", 3, 32)


def test_timm_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(UserError, match=r"--encoder timm:resnet18 needs timm: pip install -e '\.\[timm\]'"):
        resolve(Config(dataset="digits", encoder="timm:resnet18"))


def test_your_own_callable_by_spec_and_the_project_registry():
    net, width = build_backbone("test_encoders:TinyNet", 1, 8)
    assert isinstance(net, TinyNet) and width == 6 and net.conv.in_channels == 1
    encoders.register("tiny")(lambda in_channels, image_size: TinyNet(in_channels))
    try:
        assert "tiny" in ENCODERS and build_backbone("tiny", 3, 8)[1] == 6
        assert resolve(Config(dataset="digits", encoder="tiny")).encoder == "tiny"
    finally:
        del ENCODERS["tiny"]


@pytest.mark.parametrize("spec, message", [
    ("test_encoders:feature_map", r"returns \(2, 4, 6, 6\) for two images; it must return one feature vector"),
    ("test_encoders:EXAMPLE_WIDTH", "is not callable"),
    ("test_encoders:nothing", "test_encoders has no 'nothing'"),
    ("no_such_package.nets:Net", "cannot import no_such_package.nets .*PYTHONPATH"),
    ("squeezenet1_0", "--encoder squeezenet1_0: found no Linear classifier"),  # its name, not its first conv's
    ("resnet_huge", "unknown --encoder 'resnet_huge'; give one of the project's \\(resnet18, cnn\\), a torchvision"),
])
def test_bad_encoders_are_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        build_backbone(spec, 1, 8)


EXAMPLE_WIDTH = 6


def test_vit_at_a_size_its_patches_do_not_divide():
    with pytest.raises(UserError, match="vit_b_16 does not take 3-channel 30 px images .*change --image-size"):
        build_backbone("vit_b_16", 3, 30)


def test_a_checkpoint_rebuilds_a_backbone_of_your_own_and_says_when_its_code_is_missing(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_backbones.py").write_text(textwrap.dedent('''
        from torch import nn

        def small(in_channels):
            return nn.Sequential(nn.Conv2d(in_channels, 12, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten())
    '''))
    monkeypatch.syspath_prepend(str(code))
    cfg = Config(dataset="digits", encoder="my_backbones:small", proj_hidden=16, proj_dim=8, batch_size=64, epochs=1,
                 warmup_epochs=0, workers=0, max_steps=2, out=str(tmp_path / "run"))
    trainer = Trainer(cfg, progress=False)
    trainer.train(2)
    trainer.save()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["encoder"] == "my_backbones:small"
    learner, _ = load_learner(tmp_path / "run", trust_code=True)
    assert learner.backbone[0].out_channels == 12
    torch.testing.assert_close(learner.state_dict(), trainer.learner.state_dict())

    monkeypatch.delitem(sys.modules, "my_backbones")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(code)])
    with pytest.raises(UserError, match="--encoder my_backbones:small: cannot import my_backbones .*PYTHONPATH"):
        load_learner(tmp_path / "run", trust_code=True)
