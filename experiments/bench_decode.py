"""Images/s of the JPEG decoders the file path can use, on the same batches.

The decoders are those of ``data/decode.py``: nvImageCodec's, TorchCodec's and torchvision's batched decoders on
``--device``, and PIL (the worker path's reader, and the fallback where none is installed) on the CPU; their ratios,
taken within each interleaved repeat, then the median over repeats. First each decoder's pixels against PIL's, beside
those of the same JPEGs with their chroma replicated (``photos.replicated_chroma``: what a decoder without libjpeg's
smooth upsampling gives).

    python experiments/bench_decode.py                      # CPU, photo-like JPEGs of about 450 x 340
    python experiments/bench_decode.py --device cuda --size 32

The JPEGs are gpu_check.sh's (``data/photos.py``: a smooth random image with noise, quality 90, 4:2:0 chroma).
"""

import argparse
import io
import statistics
import time
import warnings

import torch
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.data.decode import JPEG_DECODERS
from bayesncl_pyro.data.photos import photo, replicated_chroma
from bayesncl_pyro.device import pick_device


def jpeg(i: int, large: bool) -> bytes:
    """Photo-like image ``i`` as JPEG bytes (quality 90), at ImageNet's usual size or 32 x 32 px."""
    buffer = io.BytesIO()
    photo(i, None if large else (32, 32)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def main():
    """Compare the decoders' pixels with PIL's, then print their images/s."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", type=int, choices=[32, 450], default=450, help="32 px, or about 450 x 340 px")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a loader worker runs one)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)  # torchvision 0.29's, at every call
    device = pick_device(args.device)
    data = [jpeg(i, args.size > 32) for i in range(args.batch)]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]

    def pil():
        return [pil_to_tensor(Image.open(io.BytesIO(d)).convert("RGB")) for d in data]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    variants = {d.name: (lambda d=d: d.decode(tensors, device)) for d in JPEG_DECODERS}
    variants["PIL (CPU)"] = pil
    reference = pil()
    replicated = [torch.from_numpy(replicated_chroma(d)).permute(2, 0, 1) for d in data]
    for name, decode in [("replicated chroma (reference)", lambda: replicated), *variants.items()]:  # warm-up, pixels
        images = decode()
        sync()
        diff = [(a.cpu().int() - b.int()).abs() for a, b in zip(images, reference, strict=True)]
        print(f"{name}: difference from PIL, mean {torch.stack([d.float().mean() for d in diff]).mean():.3f}, "
              f"largest {max(d.max().item() for d in diff)} of 255")
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, decode in variants.items():
            sync()
            tic = time.perf_counter()
            decode()
            sync()
            times[name].append(time.perf_counter() - tic)
    print(f"\n{args.batch} JPEGs of {'about 450 x 340' if args.size > 32 else '32 x 32'} px on {device}, "
          f"{args.threads} thread(s), median of {args.repeats} interleaved repeats")
    base = "PIL (CPU)"
    for name in variants:
        ratio = statistics.median(b / t for b, t in zip(times[base], times[name]))
        print(f"  {name:32s} {args.batch / statistics.median(times[name]):9.0f} images/s   x{ratio:.2f} of PIL")
    if len(JPEG_DECODERS) == 2:
        first, second = (d.name for d in JPEG_DECODERS)
        ratio = statistics.median(b / a for a, b in zip(times[first], times[second]))
        print(f"  {first} / {second} speed: {ratio:.2f}")


if __name__ == "__main__":
    main()
