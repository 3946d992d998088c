"""Backbones (images -> h, one feature vector per image) and the MLP of the projector and the gating head.

``--encoder`` (``Config.encoder``, saved with every run, so a checkpoint rebuilds its backbone) takes

* a name in ``ENCODERS``, the project's own: ``resnet18`` (the reference's) and ``cnn``; ``@register`` adds one;
* a torchvision classification model (``resnet50``, ``vit_b_16``, ``convnext_tiny``, ...), randomly
  initialised, its classifier (the last ``Linear``) replaced by ``Identity``;
* ``timm:NAME``, a timm model built with ``num_classes=0`` (``pip install -e '.[timm]'``);
* ``package.module:callable``, your own: called with ``in_channels=`` and ``image_size=`` where it takes them,
  it returns an ``nn.Module`` mapping R x C x S x S images to R x D features.

The feature width D is measured by one forward pass of two blank images. Torchvision ResNets (``resnet*``,
``resnext*``, ``wide_resnet*``) get the reference's CIFAR stem below 64 px (conv1 3x3, stride 1, padding 2,
no max-pool), so a 32 px image is not downsampled 4x before the first block; other families keep their
ImageNet stem and downsample a 32 px image as they would a 224 px one (a ViT-B/16 sees 2 x 2 patches).
Images with other than 3 channels get a first convolution that takes them.
"""

import inspect
from collections.abc import Callable

import torch
from torch import nn

from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.plugins import TIMM, Registry, import_spec, is_spec

#: a backbone below this resolution is a CIFAR-sized one: torchvision ResNets get the CIFAR stem
CIFAR_STEM_BELOW = 64

#: the project's own backbones, by name: (in_channels, image_size) -> module
ENCODERS: Registry = Registry()  # the project's own backbone builders, (in_channels, image_size) -> nn.Module
register = ENCODERS.register


def mlp(in_dim: int, hidden: int, out_dim: int, depth: int = 2) -> nn.Sequential:
    """``depth`` Linear layers with ReLU between them and no normalisation, as the reference's
    projector and gating head (depth 2: Linear -> ReLU -> Linear)."""
    if depth < 1:
        raise ValueError(f"an MLP needs depth >= 1, got {depth}")
    dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers[:-1])


@register("resnet18")
def resnet18(in_channels: int = 3, image_size: int = 32) -> nn.Module:
    """The reference's backbone: torchvision ResNet-18, randomly initialised, CIFAR stem below 64 px."""
    return torchvision_backbone("resnet18", in_channels, image_size)


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks (32-64-128-256 channels), each followed by a 2x max-pool, then a global
    average pool: a backbone for 8-32 px images that trains in minutes on a CPU."""

    def __init__(self, in_channels: int = 3, widths: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        layers: list[nn.Module] = []
        for w in widths:
            # ceil_mode keeps a 1 px map alive when an 8 px input has been halved three times
            layers += [nn.Conv2d(in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True)]
            in_channels = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.features(x)


@register("cnn")
def cnn(in_channels: int = 3, image_size: int = 32) -> nn.Module:
    return SmallCNN(in_channels)


def torchvision_backbone(name: str, in_channels: int, image_size: int) -> nn.Module:
    """A torchvision classification model without its classifier (see the module docstring)."""
    import torchvision  # late: importing it costs a second, and the command line's --help needs none of it

    net = torchvision.models.get_model(name, weights=None, **_torchvision_kwargs(name, image_size))
    for path, module in _torchvision_edits(name, net, in_channels, image_size):
        _replace(net, path, module)
    return net


def _torchvision_kwargs(name: str, image_size: int) -> dict:
    kwargs = {}
    if name.startswith("vit_"):  # its position embedding is made for one image size
        kwargs["image_size"] = image_size
    if name in ("googlenet", "inception_v3"):  # one output, not (logits, aux logits) in training mode
        kwargs.update(aux_logits=False, init_weights=True)
    return kwargs


def _torchvision_edits(name: str, net: nn.Module, in_channels: int, image_size: int) -> list[tuple[str, nn.Module]]:
    """(dotted path, new module) that make torchvision's ``net`` the backbone: the CIFAR stem of a small ResNet, a first
    convolution for other than 3 channels, the classifier (the last ``Linear``) replaced by ``Identity``."""
    import torchvision  # late: as above

    edits = []
    if isinstance(net, torchvision.models.ResNet) and image_size < CIFAR_STEM_BELOW:
        edits += [("conv1", nn.Conv2d(in_channels, net.conv1.out_channels, 3, stride=1, padding=2, bias=False)),
                  ("maxpool", nn.Identity())]
    elif in_channels != 3:
        first, conv = next((n, m) for n, m in net.named_modules() if isinstance(m, nn.Conv2d))
        edits.append((first, nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                       conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode)))
    linear = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not linear:
        raise UserError(f"--encoder {name}: found no Linear classifier to remove; wrap the model in a function "
                        "of your own that returns its feature extractor and pass it as package.module:function")
    return edits + [(linear[-1], nn.Identity())]


def torchvision_code(spec: str, in_channels: int, image_size: int) -> list[str] | None:
    """The lines of Python that build the backbone of ``--encoder spec`` from torchvision alone (``backbone = ...``,
    then its edits: :func:`torchvision_backbone`), or None when torchvision does not build it."""
    import torchvision  # late: as above

    if spec not in torchvision.models.list_models(module=torchvision.models):  # (the project's resnet18 is)
        return None
    kwargs = _torchvision_kwargs(spec, image_size)
    net = torchvision.models.get_model(spec, weights=None, **kwargs)
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    lines = [f"backbone = torchvision.models.get_model({spec!r}{args})"]
    for path, module in _torchvision_edits(spec, net, in_channels, image_size):
        attribute = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in path.split("."))
        lines.append(f"backbone{attribute} = torch.nn.{module!r}")
    return lines


def timm_backbone(name: str, in_channels: int, image_size: int) -> nn.Module:
    import timm  # late: an optional extra, --encoder timm:NAME only

    try:  # models with a position embedding take the image size; the others refuse the argument
        return timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_channels, img_size=image_size)
    except TypeError:
        return timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_channels)


def backbone_builder(spec: str) -> Callable[[int, int], nn.Module]:
    """``(in_channels, image_size) -> nn.Module`` for an ``--encoder`` value, or a ``UserError`` that says which
    forms it takes. Imports what the spec names, so a run whose code is missing fails before it trains."""
    if spec in ENCODERS:
        return ENCODERS[spec]
    if spec.startswith(TIMM):
        name = spec.removeprefix(TIMM)
        try:
            import timm  # late: an optional extra, --encoder timm:NAME only
        except ImportError:
            raise UserError(f"--encoder {spec} needs timm: pip install -e '.[timm]' (or pip install timm)") from None
        if not timm.is_model(name):
            raise UserError(f"--encoder {spec}: timm has no model {name!r} (timm.list_models() lists them)")
        return lambda in_channels, image_size: timm_backbone(name, in_channels, image_size)
    if is_spec(spec):
        fn = import_spec(spec, "--encoder")
        if not callable(fn):
            raise UserError(f"--encoder {spec} is not callable; name a class or function that returns the backbone")
        return lambda in_channels, image_size: _call_with(fn, in_channels=in_channels, image_size=image_size)
    import torchvision  # late: as above

    if spec in torchvision.models.list_models(module=torchvision.models):
        return lambda in_channels, image_size: torchvision_backbone(spec, in_channels, image_size)
    raise UserError(f"unknown --encoder {quoted(spec)}; give one of the project's ({', '.join(ENCODERS)}), a "
                    "torchvision model (resnet50, vit_b_16, convnext_tiny, ...), timm:NAME (needs timm) or "
                    "package.module:callable")


def build_backbone(spec: str, in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """(backbone, its feature width D) for an ``--encoder`` value."""
    build = backbone_builder(spec)
    try:
        net = build(in_channels, image_size)
    except UserError:
        raise
    except Exception as e:  # what a model's constructor raises for a size it cannot take (a ViT's patches)
        raise _unfit(spec, in_channels, image_size, e) from None
    if not isinstance(net, nn.Module):
        raise UserError(f"--encoder {spec} returned a {type(net).__name__}, not a torch.nn.Module")
    return net, feature_width(net, in_channels, image_size, spec)


@torch.no_grad()
def feature_width(net: nn.Module, in_channels: int, image_size: int, spec: str = "the backbone") -> int:
    """D, from one forward pass of two blank images in eval mode (BatchNorm's statistics are left unchanged)."""
    training = net.training
    try:
        out = net.eval()(torch.zeros(2, in_channels, image_size, image_size))
    except Exception as e:  # whatever a model raises for an input it cannot take
        raise _unfit(spec, in_channels, image_size, e) from None
    finally:
        net.train(training)
    if not torch.is_tensor(out) or out.ndim != 2:
        what = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise UserError(f"--encoder {spec} returns {what} for two images; it must return one feature vector per "
                        "image (2 x D): end it with a global pool and a flatten")
    return out.shape[1]


def _unfit(spec: str, in_channels: int, image_size: int, e: Exception) -> UserError:
    cause = f"{e.__class__.__name__}: {str(e).splitlines()[0]}" if str(e) else e.__class__.__name__
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e):  # the CPU's
        return UserError(f"--image-size {image_size}: two blank {in_channels}-channel {image_size} px images through "
                         f"--encoder {spec} ran out of memory ({cause}); lower --image-size")
    return UserError(f"--encoder {spec} does not take {in_channels}-channel {image_size} px images ({cause}); "
                     "change --image-size or the encoder")


def _call_with(fn, **available):
    """``fn`` called with those of ``available`` that its signature names (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        available = {k: v for k, v in available.items() if k in params}
    return fn(**available)


def _replace(net: nn.Module, name: str, new: nn.Module):
    """Set the submodule at the dotted path ``name`` to ``new``."""
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent), child, new)
