#!/usr/bin/env bash
# GPU correctness and the performance figures of docs/PERFORMANCE.md, in at most 6 minutes on one CUDA GPU
# (docs/PERFORMANCE.md, "A GPU session", gives the exact commands, what to carry and what each section must print).
#
#   bash experiments/gpu_check.sh [python] [out-folder] [wheel-folder]           # from the repository root
#   GPU_CHECK_SMOKE=1 bash experiments/gpu_check.sh .venv/bin/python /tmp/smoke   # CPU, tiny sizes: runs every section
#
# python: default python3. out-folder: default /tmp/gpu_check, never inside the repository; it gets gpu_check.txt
# (everything printed, written as it is printed: a run cut short leaves what it printed) and a few small text files,
# nothing else: the generated JPEGs and the runs' folders go to a temporary folder, removed at the end, so an out-folder
# that is brought back whole (the device tool's $OUT) stays small. wheel-folder: wheels
# installed first, with the project itself, into a temporary folder that alone goes on PYTHONPATH (models/ and guides/
# install as bayesncl_pyro.models and bayesncl_pyro.guides, so the repository on PYTHONPATH is not enough); without it
# the python must have the project installed (pip install -e .).
#
# Sections, each under its own timeout (seconds; below), all under a 6-minute budget that no section may overrun:
# 0. install and environment, in seconds: everything the later sections import is imported (every module of the
#    project, both experiment scripts), so a missing package fails here; Python, torch, torchvision, pyro, the JPEG
#    decoders, the GPU, the allocator backend, ulimit -n, the CPU count, where bayesncl_pyro is imported from; that a
#    JPEG decoder (TorchCodec's, torchvision's) decodes on the GPU (nvJPEG).
# 1. model only, ImageNet-100 recipe (ResNet-18, 224 px, K=2048, bf16 autocast, channels_last), batch 256, data
#    already on the GPU: the float32/bf16 loss against a float64 CPU reference and the BayesNCL paths against each
#    other (fails if off); images/s, Pyro/plain, BayesNCL/NCL (and its FLOPs floor), peak memory.
# 2. decoding: generated JPEG folders (32 px; ImageNet-like photos of varied sizes around 450x340), then per folder the
#    same 64 JPEGs decoded 5 times on the GPU on a side stream after queueing writes into freed blocks of the decoded
#    images' sizes (the conditions of the decoder race): the decodes must be bit-identical; and against PIL (the
#    worker path's reader) their mean |difference| at most that of the same pictures saved 4:4:4 (the control: no
#    chroma to upsample) + 0.5, and below their difference from the same JPEGs with replicated chroma (what a decoder
#    without smooth upsampling gives). Also printed, not judged: a decoder that writes from its own stream, called on
#    the side stream with work queued (how many decodes differ shows whether this GPU races at all).
# 2b. the device views: of a set held on the GPU (32 px), eager against the CPU's from the same draws, from the CUDA
#    graphs against eager (float32, and bf16 channels_last); of padded files of varied sizes (224 px, blur) against
#    the CPU's; each within float rounding, or it fails.
# 3. end to end on the 224 px folder (images of varied sizes: not held on the GPU, so nvJPEG decodes every batch),
#    batch 256: data pipeline alone and feeding BayesNCL steps, views drawn in the loader workers and on the GPU, and
#    the ratios; fails unless the device path ran on files.
# 4. the CIFAR recipe (ResNet-18, 32 px, batch 256) on the 32 px folder held on the GPU (resident), end to end; fails
#    unless the training set was held there.
# 5. correctness at 32 px: 300 steps of NCL and BayesNCL with --augment device (resident set), with the file path
#    forced (nvJPEG decoding each batch) and with --augment workers; every loss must be finite and the device curves
#    must track the workers curve (mean loss over the last third within 10 %; the smoke run's 6 steps, 50 %), or
#    it fails.
# 6. with 2 GPUs or more and time left: torchrun DDP, 20 steps.
#
# A section's timeout sends SIGTERM (a training run stops at its next step with a checkpoint, and the section ends
# there), then SIGKILL 15 s later to whatever is left; either fails the check.
# Timeouts: each is the section's CPU-smoke time (GPU_CHECK_SMOKE=1 on 2 shared CPU cores, measured 2026-12-01) times
# a stated factor; docs/PERFORMANCE.md tabulates them with what each allows per step on the GPU.
# Exit status 1 on any correctness failure, a timeout, or the budget running out.
set -uo pipefail
PY=${1:-python3}
OUT=${2:-${TMPDIR:-/tmp}/gpu_check}
WHEELS=${3:-}
REPO=$(pwd -P)
OUT=$(realpath -m "$OUT")
case "$OUT/" in
    "$REPO"/*) echo "error: the output folder $OUT is inside the repository; pick one outside it (default /tmp/gpu_check)" >&2
               exit 1 ;;
esac
mkdir -p "$OUT" || exit 1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
exec > >(tee "$OUT/gpu_check.txt") 2>&1
TEE=$!
T0=$SECONDS
BUDGET=360
status=0
section() { echo; echo "== $1 (at $(( SECONDS - T0 )) s)"; }
# limited SECONDS CMD...: CMD under min(SECONDS, what is left of the budget); a timeout or a spent budget fails the check
limited() {
    local left=$(( BUDGET - (SECONDS - T0) )) limit=$1
    shift
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then echo "FAILED: the ${BUDGET} s budget is spent"; return 1; fi
    echo "(timeout $limit s)"
    timeout -k 15 "$limit" "$@"
    local rc=$?
    (( rc == 124 || rc == 137 )) && echo "FAILED: timed out after $limit s"
    return $rc
}

section "0. install and environment"
source experiments/gpu_install.sh || exit 1
# everything the later sections import, first (every module of the project, and what the experiment scripts import
# besides), in one process: a wheel folder that lacks a package fails here, in seconds
"$PY" - "$(ulimit -n)" <<'EOF'
import importlib, io, os, pkgutil, platform, sys
import numpy, PIL, pyro, pyro.infer, torch, torch.distributed.run, torch.utils.flop_counter, torchvision
from PIL import Image
import bayesncl_pyro

root = os.path.dirname(bayesncl_pyro.__file__)
for module in pkgutil.walk_packages(bayesncl_pyro.__path__, "bayesncl_pyro."):  # data, models, guides and the rest
    imported = importlib.import_module(module.name)
    if not imported.__file__.startswith(root + os.sep):  # found elsewhere: the install lacks it
        sys.exit(f"error: {module.name} is imported from {imported.__file__}, not from {root}: the install is incomplete")
from bayesncl_pyro.data.decode import JPEG_DECODERS

print(f"bayesncl_pyro from {root}; Python {platform.python_version()}, torch {torch.__version__}, torchvision "
      f"{torchvision.__version__}, pyro {pyro.__version__}; JPEG decoders {[d.name for d in JPEG_DECODERS]}; "
      f"{os.cpu_count()} CPUs, ulimit -n {sys.argv[1]}")
device = torch.device("cpu")
if torch.cuda.is_available():
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
          f"allocator backend {torch.cuda.get_allocator_backend()}")
# each JPEG decoder on the device (nvJPEG on a GPU): data/decode.py takes the first that works there
buffer = io.BytesIO()
Image.fromarray((torch.arange(3 * 16 * 16) % 251).to(torch.uint8).view(16, 16, 3).numpy()).save(buffer, "JPEG")
jpeg = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
working = []
for decoder in JPEG_DECODERS:
    try:
        (decoded,) = decoder.decode([jpeg], device)
    except RuntimeError as err:
        print(f"{decoder.name}: decoding a 16x16 JPEG on {device}: FAILED: {err}")
        continue
    working.append(decoder.name)
    print(f"{decoder.name}: decodes a 16x16 JPEG on {device} to {tuple(decoded.shape)} on {decoded.device}: ok")
if not working:
    print(f"no JPEG decoder decodes on {device}: FAILED")
    sys.exit(2)  # the later sections run all the same
EOF
rc=$?
(( rc == 2 )) && status=1
(( rc && rc != 2 )) && exit 1
date -u
# sizes, and each section's timeout: the smoke figure of that section times the factor stated beside it
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then  # CPU, tiny: every command runs, no figure means anything
    DEV=cpu; N224=200; N32=400; W=2; PB=1; STEPS=6; DECODES=2; CHURN=64; GAP=50
    BIG=(--image-size 32 --encoder cnn --proj-hidden 32 --proj-dim 16 --batch-size 16)
    SMALL=(--encoder cnn --proj-hidden 32 --proj-dim 16 --batch-size 16); REP=(--repeats 1 --steps 1 --warmup 0 --runs 3)
    VIEWS_BATCH=16
    BUDGET=900; T1=300; T2=300; T2B=300; T3=300; T4=300; T5=300; T6=60  # a loaded CPU: only the budget guards the test
else
    DEV=cuda; N224=6000; N32=20000; W=$(( $(nproc) - 2 )); PB=20; STEPS=300; DECODES=5; CHURN=4096; GAP=10
    # bench_step runs one untimed step before each repeat's timed ones: 9 + 1 steps a repeat, 3 runs, as the budget
    BIG=(--batch-size 256); SMALL=(--batch-size 256); REP=(--repeats 3 --steps 9 --warmup 3 --runs 3)
    # smoke seconds x factor (docs/PERFORMANCE.md: what each allows per step); the sum stays under the budget
    VIEWS_BATCH=256
    T1=$(( 12 * 4 )); T2=$(( 11 * 4 )); T2B=$(( 10 * 3 )); T3=$(( 36 * 16 / 10 )); T4=$(( 6 * 6 )); T5=$(( 18 * 6 )); T6=60
fi

section "1. model only, ImageNet-100 recipe, batch 256"
limited $T1 "$PY" experiments/bench_step.py --device $DEV --dataset in100 "${BIG[@]}" "${REP[@]}" || status=1

section "2. generated JPEG folders; the decoder race; GPU decoding against PIL"
limited $T2 "$PY" - "$WORK" "$N224" "$N32" "$DEV" "$DECODES" "$CHURN" <<'EOF' || status=1
import io
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages, jpeg_decoders
from bayesncl_pyro.data.photos import replicated_chroma, write_photo_folder
from bayesncl_pyro.device import pick_device

out, n224, n32, device = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
repeats, churn_size = int(sys.argv[5]), int(sys.argv[6])

for name, n, size in (("jpeg224", n224, None), ("jpeg32", n32, (32, 32))):
    root = out / name
    if not (root / "test").exists():
        write_photo_folder(root, n, size)
    print(f"{root}: {sum(1 for _ in root.rglob('*.jpg'))} JPEGs, {'32x32' if size else '400-500 x 300-375'} px")

device = pick_device(device)
cuda = device.type == "cuda"
if cuda:
    torch.cuda.set_device(device)
side = torch.cuda.Stream(device) if cuda else None  # the input pipeline decodes from a stream of its own
decoders = jpeg_decoders(device)
# the control: a decoder that writes PyTorch's memory from a stream of its own, called on a stream with queued work
control = next((d for d in decoders if d.torch_memory), None)
print(f"JPEG decoder on {device}: {decoders[0].name if decoders else None}; control: {control and control.name}")


def churn(images):
    """Queue a long computation, then writes into blocks of the decoded images' sizes, and free them: the next
    allocations of those sizes on this stream get blocks that queued kernels will still write."""
    a = torch.randn(churn_size, churn_size, device=device)
    for _ in range(4):
        a = a @ a / churn_size
    for image in images:  # queued behind the products, so they run late; freed at once
        torch.empty(image.size, dtype=torch.uint8, device=device).fill_(7)
    return a


def mean_difference(a, b) -> float:
    return float(np.mean([np.abs(x.astype(np.int16) - y.astype(np.int16)).mean() for x, y in zip(a, b, strict=True)]))


def hwc(images):
    return [image.cpu().permute(1, 2, 0).numpy() for image in images]


def jpeg_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


failed = False
for name in ("jpeg32", "jpeg224"):
    encoded = EncodedImages(load_dataset("imagefolder", out / name).train)
    batch = EncodedBatch([encoded[i] for i in range(64)])
    data = [bytes(item.numpy()) for item, _ in batch]
    pil = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in data]  # the worker path's reader
    with torch.cuda.stream(side):
        decodes, raw = [], []
        for _ in range(repeats):
            churn(pil)
            decodes.append(encoded.decode(batch, device))  # as the input pipeline decodes
        for _ in range(repeats if control else 0):
            churn(pil)
            raw.append(control.decode([item for item, _ in batch], device))
    if cuda:
        torch.cuda.synchronize(device)

    def differing(runs):
        return sum(any(not torch.equal(a, b) for a, b in zip(runs[0], run)) for run in runs[1:])

    # the same pictures saved 4:4:4 (no chroma subsampling): a difference left there is not the chroma upsampling
    full = []
    for image in pil:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG", quality=90, subsampling=0)
        full.append(buffer.getvalue())
    pil444 = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in full]
    gpu444 = encoded.decode(EncodedBatch([(jpeg_tensor(d), j) for d, (_, j) in zip(full, batch)]), device)
    gpu, replicated = hwc(decodes[0]), [replicated_chroma(d) for d in data]
    to_pil, to_replicated = mean_difference(gpu, pil), mean_difference(gpu, replicated)
    control444, reference = mean_difference(hwc(gpu444), pil444), mean_difference(replicated, pil)
    worst = max(int(np.abs(a.astype(np.int16) - b).max()) for a, b in zip(gpu, pil))
    same = differing(decodes) == 0
    accurate = to_pil <= control444 + 0.5 and to_pil < to_replicated
    failed |= not (same and accurate)
    print(f"{name}: 64 JPEGs decoded {repeats} times on {device} under allocator churn: "
          f"{repeats - 1 - differing(decodes)} of {repeats - 1} repeats bit-identical to the first "
          f"{'ok' if same else 'FAILED'}")
    print(f"{name}: mean |GPU - PIL| {to_pil:.3f} (max {worst}) of 255; the 4:4:4 control {control444:.3f}; mean "
          f"|GPU - replicated chroma| {to_replicated:.3f} (PIL's {reference:.3f}); limit: the control + 0.5, and "
          f"nearer PIL than replicated chroma {'ok' if accurate else 'FAILED'}")
    if control:
        print(f"{name}: {control.name} on a stream with queued work (control, not judged): {differing(raw)} of "
              f"{repeats - 1} repeats differ")
sys.exit(1 if failed else 0)
EOF

section "2b. the device views on $DEV: CUDA graphs against eager, and against the CPU's"
limited $T2B "$PY" - "$DEV" "$VIEWS_BATCH" <<'EOF' || status=1
import sys

import torch

from bayesncl_pyro.data import pipeline
from bayesncl_pyro.data.device_views import BatchViews
from bayesncl_pyro.device import pick_device

device, n = pick_device(sys.argv[1]), int(sys.argv[2])
cpu = torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
g = torch.Generator().manual_seed(0)
images = torch.randint(0, 256, (4 * n, 3, 32, 32), dtype=torch.uint8, generator=g)
rows = [torch.randint(0, 4 * n, (n,), generator=g) for _ in range(4)]
failed = False


def report(what, got, expected, limit):
    global failed
    worst = max((a.float().cpu() - b.float().cpu()).abs().max().item() for a, b in zip(got, expected, strict=True))
    failed |= not worst <= limit
    print(f"{what}: largest difference {worst:.2e} (limit {limit:.0e}) {'ok' if worst <= limit else 'FAILED'}")


# the set held on the device, 32 px: the graphs' replays (CUDA) and eager views there, against the CPU's (float32);
# the same draws, so the only differences are float32 rounding in another order
on_device = pipeline.ResidentViews(images.to(device), 32, seed=0)
eager = [on_device(r, k) for k, r in enumerate(rows)]
report(f"32 px views of a set held on {device}, eager, against the CPU's", eager,
       [pipeline.ResidentViews(images, 32, seed=0)(r, k) for k, r in enumerate(rows)], 1e-3)
if device.type == "cuda":
    replayed = [x.clone() for x in on_device.replayed(rows, first=0)]
    report("the same from CUDA graphs against eager", replayed, eager, 1e-3)
    bf16 = pipeline.ResidentViews(images.to(device), 32, 0, dtype=torch.bfloat16, memory_format=torch.channels_last)
    replayed = [x.clone() for x in bf16.replayed(rows, first=0)]
    assert all(x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last) for x in replayed)
    report("the same in bf16 channels_last against float32", replayed, eager, 3e-2)
else:
    print("no CUDA: the graphs are not run")
# files, 224 px (blur): a padded batch of varied sizes on the device against the CPU's
files = [torch.randint(0, 256, (3, 300 + 9 * k % 76, 400 + 13 * k % 101), dtype=torch.uint8, generator=g)
         for k in range(n)]
report(f"224 px views of {n} files of varied sizes on {device}, eager, against the CPU's",
       [BatchViews(n, 224, 3, device)([f.to(device) for f in files], torch.Generator().manual_seed(1))],
       [BatchViews(n, 224, 3, cpu)(files, torch.Generator().manual_seed(1))], 1e-3)
sys.exit(1 if failed else 0)
EOF

section "3. end to end, 224 px JPEG folder of varied sizes (files: nvJPEG per batch), batch 256, both data paths"
limited $T3 "$PY" experiments/bench_step.py --device $DEV --dataset imagefolder --data-dir "$WORK/jpeg224" \
    --image-size 224 --encoder resnet18 --proj-hidden 16384 --proj-dim 2048 "${BIG[@]}" --repeats 1 --steps 2 \
    --runs 3 --warmup 1 --pipeline-batches $PB --workers "$W" --augment both 2>&1 | tee "$OUT/section3.txt"
rc=$?
if (( rc )); then status=1
elif grep -q "warning: nvJPEG failed" "$OUT/section3.txt"; then
    echo "section 3: nvJPEG failed on generated JPEGs (decoded around, image by image): FAILED"; status=1
elif grep -q "device augmentation (device, files decoded per batch" "$OUT/section3.txt"; then
    echo "section 3 drew the device views from files decoded per batch: ok"
else echo "section 3 did not run the file path: FAILED"; status=1; fi

section "4. CIFAR recipe on a 32 px JPEG folder held on the device, batch 256"
limited $T4 "$PY" experiments/bench_step.py --device $DEV --dataset cifar10 --data-dir "$WORK/jpeg32" "${SMALL[@]}" \
    --repeats 1 --steps 2 --runs 3 --warmup 1 --pipeline-batches $(( PB * 2 )) --workers "$W" --augment device 2>&1 \
    | tee "$OUT/section4.txt"
rc=$?
if (( rc )); then status=1
elif grep -q "device augmentation (device, training set held there" "$OUT/section4.txt"; then
    echo "section 4 held the training set on the device: ok"
else echo "section 4 did not hold the training set on the device: FAILED"; status=1; fi

section "5. $STEPS steps at 32 px: device (resident), device (files, nvJPEG per batch) and workers loss curves"
limited $T5 "$PY" - "$WORK" "$DEV" "$STEPS" "$W" "$GAP" "${SMALL[@]}" <<'EOF' || status=1
import contextlib
import json
import math
import sys
import time
from unittest import mock

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import pipeline
from bayesncl_pyro.errors import Stopped
from bayesncl_pyro.train.trainer import Trainer

out, device, steps, workers, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
extra = sys.argv[6:]
size = dict(zip((a.lstrip("-").replace("-", "_") for a in extra[::2]), extra[1::2]))
size = {k: (int(v) if v.isdigit() else v) for k, v in size.items()}
failed = False
for method in ("ncl", "bayesncl"):
    curves = {}
    for path in ("device", "files", "workers"):
        tic = time.perf_counter()
        cfg = Config(dataset="cifar10", data_dir=f"{out}/jpeg32", method=method, device=device, workers=workers,
                     augment="workers" if path == "workers" else "device", max_steps=steps, log_every=max(steps // 30, 1),
                     ckpt_every=10**9, out=f"{out}/curve_{method}_{path}", **size)
        # files: the training set is not held on the device, so every batch is decoded there (nvJPEG)
        with mock.patch.object(pipeline, "resident_images", return_value=None) if path == "files" else contextlib.nullcontext():
            trainer = Trainer(cfg, progress=False, overwrite=True)
            start = time.perf_counter()
            try:
                trainer.train(steps)
            except Stopped:  # the section's timeout (SIGTERM): the checkpoint is written, the section ends here
                raise
            except Exception as err:  # noqa: BLE001 -- a divergence is the failure this looks for
                print(f"{method} {path}: FAILED: {err}")
                failed = True
                continue
        log = [json.loads(line) for line in open(f"{out}/curve_{method}_{path}/log.jsonl")]
        curves[path] = [r["loss"] for r in log]
        print(f"{method} {path}: {len(log)} records, loss {curves[path][0]:.3f} -> {curves[path][-1]:.3f}, "
              f"{1e3 * (time.perf_counter() - start) / steps:.1f} ms/step, set-up {start - tic:.1f} s")
    for path in ("device", "files"):
        if path not in curves or "workers" not in curves:
            continue
        a, b = curves[path], curves["workers"]
        tail = max(len(b) // 3, 1)
        gap = abs(sum(a[-tail:]) / tail - sum(b[-tail:]) / tail) / abs(sum(b[-tail:]) / tail)
        ok = all(math.isfinite(v) for v in a) and 100 * gap <= limit
        failed |= not ok
        print(f"{method} {path} vs workers: all finite {all(math.isfinite(v) for v in a)}, mean loss over the last "
              f"{tail} records differs by {100 * gap:.1f} % (limit {limit} %) {'ok' if ok else 'FAILED'}")
sys.exit(1 if failed else 0)
EOF

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if (( NGPU >= 2 )); then
    section "6. torchrun DDP on $NGPU GPUs"
    limited $T6 "$PY" -m torch.distributed.run --nproc_per_node="$NGPU" experiments/run_svi.py --dataset imagefolder \
        --data-dir "$WORK/jpeg224" --image-size 224 --batch-size 256 --epochs 1 --warmup-epochs 0 --max-steps 20 \
        --log-every 5 --workers 4 --out "$WORK/ddp_run" --overwrite || status=1
fi
echo
echo "gpu_check: exit status $status after $(( SECONDS - T0 )) s (budget $BUDGET s)"
exec >&- 2>&-
wait $TEE  # gpu_check.txt complete before the exit
exit $status
