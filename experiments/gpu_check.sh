#!/usr/bin/env bash
# GPU correctness and the performance figures of docs/PERFORMANCE.md, in a few minutes on one CUDA GPU.
#
#   bash experiments/gpu_check.sh [python] [out-folder]        # from the repository root
#
# 1. correctness + model-only ceiling: bench_step.py at the ImageNet-100 recipe (ResNet-18, 224 px,
#    K=2048, bf16 autocast, channels_last) on batches already on the GPU. It first checks the GPU loss
#    (float32 and bf16 autocast) against a float64 CPU reference and the three BayesNCL paths against
#    each other, and exits non-zero if any is off. Prints images/s, Pyro/plain, BayesNCL/NCL, peak
#    memory per batch size (128, 256, 512).
# 2. the same with torch.compile of the encoder (time-limited: compilation takes a while).
# 3. end to end with real JPEG decoding: synthetic JPEGs (500x375, smooth content + noise, about
#    the size of ImageNet files) in an ImageFolder tree. First the GPU data path against the CPU one
#    (nvjpeg vs libjpeg decoding; the same views from the same images), then the data pipeline alone and
#    feeding BayesNCL steps with the views drawn in the loader workers (--augment workers) and on the GPU
#    (--augment device: nvjpeg batch decoding, batched augmentation), and their ratio; then a short
#    run_svi training with --augment device.
# 4. with two or more GPUs, a short torchrun DDP run.
# Everything printed is also written to <out-folder>/gpu_check.txt.
set -uo pipefail
PY=${1:-python}
OUT=${2:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/gpu_check.txt
exec > >(tee "$LOG") 2>&1
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
status=0

echo "== 1. correctness and model-only ceiling (ResNet-18, 224 px, batch 256)"
timeout 420 "$PY" experiments/bench_step.py --device cuda --dataset in100 --batch-size 256 \
    --repeats 5 --steps 10 --warmup 3 --memory-batches 128,256,512 || status=1

echo "== 2. torch.compile of the encoder (batch 256)"
timeout 300 "$PY" experiments/bench_step.py --device cuda --dataset in100 --batch-size 256 \
    --repeats 3 --steps 10 --warmup 3 --compile || echo "(compile run failed or timed out)"

echo "== 3. end to end with JPEG decoding (batch 256)"
DATA=$OUT/jpegs
"$PY" - "$DATA" <<'EOF'
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

root = Path(sys.argv[1])

def write(i):
    rng = np.random.default_rng(i)
    split, cls = ("val", i % 100) if i >= 12_000 else ("train", i % 100)
    low = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize((500, 375), Image.BICUBIC), dtype=np.float32)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    path = root / split / f"c{cls:03d}" / f"{i}.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).save(path, quality=90)

if not (root / "val").exists():
    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(write, range(12_200), chunksize=200))
print(f"{root}: {sum(1 for _ in root.rglob('*.jpg'))} JPEGs")
EOF
timeout 120 "$PY" - "$DATA" <<'EOF' || status=1
import sys

import torch

from bayesncl_pyro.data import EncodedImages, load_dataset
from bayesncl_pyro.device_augment import simclr_views

encoded = EncodedImages(load_dataset("imagefolder", sys.argv[1]).train)
batch = [encoded[i] for i in range(64)]
cpu, gpu = encoded.decode(batch, torch.device("cpu")), encoded.decode(batch, torch.device("cuda"))
diff = torch.cat([(c.float() - g.cpu().float()).abs().flatten() for c, g in zip(cpu, gpu)])
print(f"nvjpeg vs CPU decoding of 64 JPEGs: mean |difference| {diff.mean():.3f}, max {diff.max():.0f} (of 255)")
a = simclr_views(cpu, 224, torch.Generator().manual_seed(0))
b = simclr_views([c.cuda() for c in cpu], 224, torch.Generator().manual_seed(0)).cpu()
worst = (a - b).abs().max().item()
print(f"views of the same images, GPU vs CPU: max |difference| {worst:.1e} (normalised units; TF32 convolutions)")
if diff.mean() > 2 or not worst < 5e-2:
    sys.exit("error: the GPU data path is off the CPU one")
EOF
W=$(( $(nproc) - 2 ))
timeout 420 "$PY" experiments/bench_step.py --device cuda --dataset imagefolder --data-dir "$DATA" \
    --image-size 224 --encoder resnet18 --proj-hidden 16384 --proj-dim 2048 --batch-size 256 \
    --repeats 1 --steps 3 --warmup 1 --pipeline-batches 40 --workers "$W" --augment both || status=1
timeout 300 "$PY" experiments/run_svi.py --dataset imagefolder --data-dir "$DATA" --train-subset 5120 \
    --image-size 224 --batch-size 256 --epochs 2 --warmup-epochs 0 --max-steps 30 --log-every 10 \
    --workers "$W" --augment device --out "$OUT/device_run" --overwrite || status=1

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
    echo "== 4. torchrun DDP on $NGPU GPUs"
    timeout 300 torchrun --nproc_per_node="$NGPU" experiments/run_svi.py --dataset imagefolder --data-dir "$DATA" \
        --image-size 224 --batch-size 256 --epochs 1 --warmup-epochs 0 --max-steps 20 --log-every 5 \
        --workers 4 --out "$OUT/ddp_run" || status=1
fi
echo "gpu_check: exit status $status"
exit $status
