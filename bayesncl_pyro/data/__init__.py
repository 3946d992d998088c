"""The input side: dataset -> images -> two augmented views per image, on the CPU or the training device.

One job a file, imported in this order (no file imports one below it):

- ``images``: what a split holds (``TensorImages`` in memory, ``ImageFiles`` on disk) and ``DataSpec``.
- ``compositional``: the generated benchmark with known factors (the default dataset).
- ``photos``: generated photo-like images and JPEG folders, for the benchmarks, the GPU check and the tests.
- ``datasets``: ``load_dataset`` for digits, CIFAR-10/100, image folders and ImageNet-100, from local files.
- ``decode``: image files decoded in batches on the training device (nvJPEG on CUDA).
- ``resident``: a training set of small equal-size images held on the training device.
- ``recipe``: SimCLR's augmentation constants and blur kernel.
- ``device_views``: both views of a whole batch drawn with batched kernels on the training device.
- ``views``: views drawn image by image in DataLoader workers (using ``device_views``' ops on one image),
  the evaluation transform, the two-view dataset.
- ``pipeline``: the training steps' input: where the views are drawn, the epoch order; on the device path
  prefetched on its own CUDA stream.
"""

from bayesncl_pyro.data.datasets import DATASETS, imagenet100_classes, load_dataset
from bayesncl_pyro.data.images import DataSpec, ImageFiles, TensorImages, image_files

__all__ = ["DATASETS", "DataSpec", "ImageFiles", "TensorImages", "image_files", "imagenet100_classes", "load_dataset"]
