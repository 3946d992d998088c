#!/usr/bin/env bash
# The paper's CIFAR-100 comparison at its recipe (ResNet-18, --recipe reference, the reference's evaluation), NCL
# against BayesNCL-STE at the published prior, seeds 0 and 1, as many epochs as fit MINUTES: one compare.py command,
# whose budget plan gives every run the same epochs (its four runs one after another: runs sharing the GPU at once
# would each time their steps alone and plan apart). Every evaluation holds both consistencies (the paper's and the
# top-N one) and the gated runs' controls; the comparison pairs the seeds.
#
#   bash experiments/gpu_paper_cifar100.sh PYTHON OUT WHEELS CIFAR100 [MINUTES]     # on the GPU machine
#   GPU_SMOKE=1 bash experiments/gpu_paper_cifar100.sh .venv/bin/python /tmp/out "" /tmp/cifar100   # CPU dry run
#
# WHEELS: the wheel folder experiments/gpu_install.sh installs ("" when PYTHON has the project installed). CIFAR100:
# the data set's folder ({train,test}/<class>/) or its .tar.gz. MINUTES: default 8. OUT gets paper-cifar100.txt
# (everything printed) and paper-cifar100.tar.gz (the records and the comparison: the device tool brings back few
# files, and none whose name holds '+'). The smoke run trains 2 steps on 600 images (6 a class, 2 a class in its test
# split), with the small CNN for ResNet-18, on the CPU.
set -uo pipefail
PY=$1 OUT=$(realpath -m "$2") WHEELS=$3 DATA=$4 MINUTES=${5:-8}
mkdir -p "$OUT" || exit 1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/paper_cifar100.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
exec > >(tee "$OUT/paper-cifar100.txt") 2>&1
source experiments/gpu_install.sh || exit 1
if [[ $DATA == *.tar.gz ]]; then tar xzf "$DATA" -C "$WORK" && DATA=$WORK/cifar100 || exit 1; fi
if [[ ${GPU_SMOKE:-} == 1 ]]; then  # the plumbing only: 6 training and 2 test images a class, 2 steps
    for split in train:6 test:2; do
        for class in "$DATA/${split%:*}"/*/; do
            mkdir -p "$WORK/small/${split%:*}/$(basename "$class")"
            find "$class" -type f | sort | head -n "${split#*:}" | xargs cp -t "$WORK/small/${split%:*}/$(basename "$class")"
        done
    done
    DATA=$WORK/small
    shared=(--device cpu --workers 0 --max-steps 2 --batch-size 64 --eval-protocol fast --encoder cnn --proj-hidden 64)
    budget=()
else
    shared=(--device cuda --workers 6)
    budget=(--budget-minutes "$MINUTES")
fi
status=0
timeout -k 15 $(( 60 * MINUTES + 300 )) "$PY" experiments/compare.py --dataset cifar100 --data-dir "$DATA" \
    --recipe reference --methods ncl,bayesncl-ste --seeds 0 1 "${shared[@]}" "${budget[@]}" --out "$WORK/runs" \
    --record "$WORK/record" || status=1
tar czf "$OUT/paper-cifar100.tar.gz" -C "$WORK" record || status=1
exit $status
