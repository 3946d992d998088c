#!/bin/bash
# run_svi.py as a SLURM job: one torchrun launcher per node, one training process per GPU, and a job that
# requeues itself before its time limit and resumes where it stopped. Pass run_svi.py's flags, always with the
# same --out on a file system that every node sees (the requeued job resumes from the checkpoint there), from
# the repository's root:
#
#   sbatch --nodes=2 experiments/slurm_svi.sh --dataset in100 --data-dir /data/imagenet --out /shared/runs/in100
#
# Five minutes before the time limit SLURM sends SIGUSR1 to this script only (B: below: a torchrun launcher
# would die of it, SIGUSR1's default action). The script then sends SIGTERM to the training step; torchrun
# forwards it to its workers, which agree on one step, save a checkpoint there and exit with 75 (requeue me),
# and the script requeues the job: it waits in the queue and, when it runs again, resumes from that checkpoint.
# A worker that dies (a crashed process, a GPU error) is restarted by torchrun from the last checkpoint, up to
# --max-restarts times. Pre-emption by a higher-priority job (SIGTERM to everything) saves the same way;
# SLURM's PreemptMode=REQUEUE requeues such a job by itself.
#
#SBATCH --job-name=bayesncl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -u
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # serves the rendezvous store
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
# torchrun would share its rendezvous store with the workers, and a restarted group could read the addresses
# of the previous one and hang (run_svi.py refuses to start so)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times): $SLURM_JOB_NUM_NODES node(s), rendezvous at $head:$port"

warned=0
trap 'warned=1; echo "time limit near: the run saves a checkpoint"; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
trap 'echo "terminated: the run saves a checkpoint"' TERM  # and this script waits for it

srun --kill-on-bad-exit=1 torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="${SLURM_GPUS_ON_NODE:-1}" \
    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" --max-restarts=3 \
    experiments/run_svi.py "$@" &
step=$!
wait $step
status=$?
while kill -0 $step 2>/dev/null; do  # a trapped signal ends `wait` early: wait again for the step to end
    wait $step
    status=$?
done

# torchrun reports a stopped group as failed (status 1), so the warning, not the status, says "requeue me"
if [ "$warned" = 1 ] && [ "$status" != 0 ]; then
    echo "requeueing job $SLURM_JOB_ID: it resumes from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit $status
