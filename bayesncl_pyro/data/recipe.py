"""SimCLR's augmentation recipe (Chen et al. 2020) for colour images.

The constants and the blur kernel that the per-image views (``views.py``) and the batched device views
(``device_views.py``) share.
"""

from __future__ import annotations

import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
JITTER, P_JITTER = (0.8, 0.8, 0.8, 0.2), 0.8  # brightness, contrast, saturation, hue
P_GRAY, P_BLUR, P_FLIP = 0.2, 0.5, 0.5
BLUR_SIGMA = (0.1, 2.0)


def blur_kernel(image_size: int) -> int | None:
    """The Gaussian blur's kernel size: odd, about 10% of the image side, at least 3 (SimCLR's choice).

    None (no blur) at 32 px and below: the reference recipe blurs at every size, but there a blur with
    sigma up to 2 wipes out most of the image's detail.
    """
    return None if image_size <= 32 else max(3, image_size // 10 // 2 * 2 + 1)



def blur_taps(sigma: float | torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Torchvision's 1-D Gaussian kernel, without its negligible outer taps.

    ``kernel_size`` taps; ``B x kernel_size`` for B sigmas. Taps below 1e-10 are zero: they move no pixel by a
    millionth of a grey level, and for sigma 0.3-0.8 they are subnormal floats, on which x86 arithmetic is slow
    (torchvision's blur pays for that).
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    t = torch.arange(kernel_size, device=sigma.device) - (kernel_size - 1) / 2
    taps = torch.softmax(-0.5 * (t / sigma[..., None]) ** 2, -1)
    return torch.where(taps > 1e-10, taps, 0)
