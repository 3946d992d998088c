#!/usr/bin/env bash
# GPU correctness and the performance figures of docs/PERFORMANCE.md, in under 8 minutes on one CUDA GPU.
#
#   bash experiments/gpu_check.sh [python] [out-folder] [wheel-folder]      # from the repository root
#   GPU_CHECK_SMOKE=1 bash experiments/gpu_check.sh .venv/bin/python /tmp/smoke   # CPU, tiny sizes: runs every step
#
# wheel-folder: wheels to install first into a temporary folder on PYTHONPATH (the GPU machine lacks pyro-ppl,
# pyro-api, arviz, xarray-einstats, h5netcdf, platformdirs).
# Sections, each under its own `timeout` (the sum stays under 8 minutes), figures printed as they come:
# 1. model only, ImageNet-100 recipe (ResNet-18, 224 px, K=2048, bf16 autocast, channels_last), batch 256, data
#    already on the GPU: the float32/bf16 loss against a float64 CPU reference and the BayesNCL paths against each
#    other (exits non-zero if off), images/s, Pyro/plain, BayesNCL/NCL (and its FLOPs floor), peak memory.
# 2. the same with torch.compile of the encoder.
# 3. decoding: nvJPEG vs PIL on generated JPEGs at 32 and 224 px (mean |difference| <= 1/255 or it fails).
# 4. end to end on 500x375 JPEG folders, 224 px, batch 256: data pipeline alone and feeding BayesNCL steps,
#    views drawn in the loader workers and on the GPU (files decoded per batch, prefetched), and the ratios.
# 5. the CIFAR recipe (ResNet-18, 32 px, batch 256) on a 32 px JPEG folder held on the GPU (resident), end to end.
# 6. correctness at 32 px: 300 steps of NCL and BayesNCL with --augment device (resident set), with the file path
#    forced (nvJPEG decoding each batch: where the decoder's race made NaNs), and with --augment workers; every
#    loss must be finite and the device curves must track the workers curve, or it fails.
# Everything printed is also written to <out-folder>/gpu_check.txt. Exit status 1 on any correctness failure.
set -uo pipefail
PY=${1:-python}
OUT=${2:-gpu_check_out}
WHEELS=${3:-}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$WHEELS" ]; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=$SITE:$PYTHONPATH
fi
LOG=$OUT/gpu_check.txt
exec > >(tee "$LOG") 2>&1
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then  # CPU, tiny: every command runs, no figure means anything
    DEV=cpu; N224=300; N32=600; BIG=(--image-size 64 --encoder cnn --proj-hidden 32 --proj-dim 16 --batch-size 32)
    SMALL=(--encoder cnn --proj-hidden 32 --proj-dim 16 --batch-size 32); PB=2; STEPS=12; W=2; REP=(--repeats 1 --steps 1 --warmup 0)
else
    DEV=cuda; N224=12200; N32=20000; BIG=(--batch-size 256); SMALL=(--batch-size 256); PB=30; STEPS=300
    W=$(( $(nproc) - 2 )); REP=(--repeats 3 --steps 10 --warmup 3)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
date -u; nproc
status=0
T0=$SECONDS
section() { echo; echo "== $1 (at $(( SECONDS - T0 )) s)"; }

section "1. model only, ImageNet-100 recipe, batch 256"
timeout 75 "$PY" experiments/bench_step.py --device $DEV --dataset in100 "${BIG[@]}" "${REP[@]}" || status=1

section "2. torch.compile of the encoder"
timeout 90 "$PY" experiments/bench_step.py --device $DEV --dataset in100 "${BIG[@]}" "${REP[@]}" --compile \
    || echo "(compile run failed or timed out: a figure, not a correctness check)"

section "3. generated JPEG folders; nvJPEG vs PIL decoding"
timeout 40 "$PY" - "$OUT" "$N224" "$N32" <<'EOF' || status=1
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

out, n224, n32 = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def write(job):
    """A smooth random photo with noise (about the size of an ImageNet file at 500x375), q90, 4:2:0 chroma."""
    root, i, n, size = job
    rng = np.random.default_rng(i)
    split = "test" if (i // 10) % 50 == 0 else "train"  # every class in both splits, 2 % held out
    low = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize(size, Image.BICUBIC), dtype=np.float32)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    path = root / split / f"c{i % 10}" / f"{i}.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).save(path, quality=90)

for name, n, size in (("jpeg224", n224, (500, 375)), ("jpeg32", n32, (32, 32))):
    root = out / name
    if not (root / "test").exists():
        with ProcessPoolExecutor(mp_context=multiprocessing.get_context("fork")) as pool:
            list(pool.map(write, [(root, i, n, size) for i in range(n)], chunksize=200))
    print(f"{root}: {sum(1 for _ in root.rglob('*.jpg'))} JPEGs of {size[0]}x{size[1]}")
EOF
timeout 30 "$PY" - "$OUT" "$DEV" <<'EOF' || status=1
import sys

import torch

from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.decode import EncodedImages

out, device = sys.argv[1], torch.device(sys.argv[2])
failed = False
for name in ("jpeg32", "jpeg224"):
    encoded = EncodedImages(load_dataset("imagefolder", f"{out}/{name}").train)
    diffs = []
    for start in range(0, 256, 64):  # four batches, each decoded while the last one's buffers are freed
        batch = [encoded[i] for i in range(start, start + 64)]
        pil = encoded.decode(batch, torch.device("cpu"))
        for _ in range(3):  # allocator churn on the decoding stream between decodes: the race's conditions
            gpu = encoded.decode(batch, device)
            junk = [torch.randn(512, 512, device=device) @ torch.randn(512, 512, device=device) for _ in range(4)]
            del junk
        diffs.append(torch.cat([(p.float() - g.cpu().float()).abs().flatten() for p, g in zip(pil, gpu)]))
    diff = torch.cat(diffs)
    ok = diff.mean() <= 1.0
    failed |= not ok
    print(f"{name}: GPU vs PIL decoding of 256 JPEGs: mean |difference| {diff.mean():.3f}, max {diff.max():.0f} "
          f"(of 255; limit on the mean 1) {'ok' if ok else 'FAILED'}")
sys.exit(1 if failed else 0)
EOF

section "4. end to end, 500x375 JPEG folders, 224 px, batch 256, both data paths"
timeout 95 "$PY" experiments/bench_step.py --device $DEV --dataset imagefolder --data-dir "$OUT/jpeg224" \
    --image-size 224 --encoder resnet18 --proj-hidden 16384 --proj-dim 2048 "${BIG[@]}" --repeats 1 --steps 3 \
    --warmup 1 --pipeline-batches $PB --workers "$W" --augment both || status=1

section "5. CIFAR recipe on a 32 px JPEG folder held on the device, batch 256"
timeout 50 "$PY" experiments/bench_step.py --device $DEV --dataset cifar10 --data-dir "$OUT/jpeg32" "${SMALL[@]}" \
    --repeats 1 --steps 3 --warmup 1 --pipeline-batches $(( PB * 2 )) --workers "$W" --augment device || status=1

section "6. $STEPS steps at 32 px: device (resident), device (files, nvJPEG per batch) and workers loss curves"
timeout 95 "$PY" - "$OUT" "$DEV" "$STEPS" "$W" "${SMALL[@]}" <<'EOF' || status=1
import contextlib
import json
import math
import sys
from unittest import mock

from bayesncl_pyro import training
from bayesncl_pyro.config import Config
from bayesncl_pyro.training import Trainer

out, device, steps, workers, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
size = dict(zip((a.lstrip("-").replace("-", "_") for a in extra[::2]), extra[1::2]))
size = {k: (int(v) if v.isdigit() else v) for k, v in size.items()}
failed = False
for method in ("ncl", "bayesncl"):
    curves = {}
    for path in ("device", "files", "workers"):
        cfg = Config(dataset="cifar10", data_dir=f"{out}/jpeg32", method=method, device=device, workers=workers,
                     augment="workers" if path == "workers" else "device", max_steps=steps, log_every=10,
                     ckpt_every=10**9, out=f"{out}/curve_{method}_{path}", **size)
        # files: the training set is not held on the device, so every batch is decoded there (nvJPEG)
        with mock.patch.object(training, "resident_images", return_value=None) if path == "files" else contextlib.nullcontext():
            trainer = Trainer(cfg, progress=False, overwrite=True)
            try:
                trainer.train(steps)
            except Exception as err:  # noqa: BLE001 -- a divergence is the failure this looks for
                print(f"{method} {path}: FAILED: {err}")
                failed = True
                continue
        log = [json.loads(line) for line in open(f"{out}/curve_{method}_{path}/log.jsonl")]
        curves[path] = [r["loss"] for r in log]
        rate = sum(r["images_per_s"] for r in log[1:]) / max(len(log) - 1, 1)
        print(f"{method} {path}: {len(log)} records, loss {curves[path][0]:.3f} -> {curves[path][-1]:.3f}, "
              f"{rate:.0f} images/s")
    for path in ("device", "files"):
        if path not in curves or "workers" not in curves:
            continue
        a, b = curves[path], curves["workers"]
        tail = max(len(b) // 3, 1)
        gap = abs(sum(a[-tail:]) / tail - sum(b[-tail:]) / tail) / abs(sum(b[-tail:]) / tail)
        ok = all(math.isfinite(v) for v in a) and gap <= 0.1
        failed |= not ok
        print(f"{method} {path} vs workers: all finite {all(math.isfinite(v) for v in a)}, mean loss over the last "
              f"{tail} records differs by {100 * gap:.1f} % (limit 10 %) {'ok' if ok else 'FAILED'}")
sys.exit(1 if failed else 0)
EOF

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ] && [ $(( SECONDS - T0 )) -lt 400 ]; then
    section "7. torchrun DDP on $NGPU GPUs"
    timeout 60 torchrun --nproc_per_node="$NGPU" experiments/run_svi.py --dataset imagefolder --data-dir "$OUT/jpeg224" \
        --image-size 224 --batch-size 256 --epochs 1 --warmup-epochs 0 --max-steps 20 --log-every 5 \
        --workers 4 --out "$OUT/ddp_run" --overwrite || status=1
fi
echo
echo "gpu_check: exit status $status after $(( SECONDS - T0 )) s"
exit $status
