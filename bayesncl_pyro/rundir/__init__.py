"""A run folder: claiming it, moving an earlier run aside, and every read and write of a file in it.

    bayesncl-pyro.run  our marker, written when a run claims the folder: only a folder that holds it (or, from a
                    version before it, a checkpoint of ours) is taken for a run, resumed or moved aside
    config.json     the resolved Config (what was actually run)
    checkpoint.pt   state_dicts, optimizer, scheduler, RNG states, step; replaced atomically
    log.jsonl       one JSON object every ``log_every`` steps (with ``warnings`` when the gates degenerate); a
                    resume cuts it, and conflict.jsonl, back to its checkpoint's step (:func:`cut_records`)
    conflict.jsonl  the per-dimension InfoNCE gradient conflict every ``conflict_every`` steps (diagnostics.py)
    eval.json       the evaluation of the final model
    gates.nc        BayesNCL only: the gate posterior on the test split, as ArviZ data (arviz_export.py)
    bad_images.txt  with --skip-bad-images: the unreadable files that were skipped, one per line
    run.lock        locked (flock) by the process training in the folder, whose pid it holds
    report/, inspect/, wandb/   what report.py, inspect_gates.py and --wandb write

Nothing here deletes a user's file: an earlier run is moved into a ``previous-<time>`` subfolder, a folder that
holds anything else is refused, and every file is replaced by a rename, so a crash mid-write leaves the previous
version intact (its temporary file, named by the writing process, is removed by the next run in the folder).

A run folder is data, perhaps from elsewhere, and every reader and writer of one (the trainer, report, inspect_gates,
export, compare --record, load_run) goes through the one rule here: a file in it is opened from a descriptor of the
run folder (the one its lock opened, where this process holds it, or the one a reader of several files opened
once, :class:`RunFolder`), no name on the way a symbolic link, and only if it
is a regular file (:func:`open_file`; a link, a FIFO or a device is refused in one line naming it, and a file written
in place, the lock or a log, that has other hard links), a read takes at most a limit in
bytes (the records of a log, at most ``MAX_RECORDS``), and a write goes to a temporary file and is renamed into a
real folder (:func:`save_together`, :func:`output_folder`; a folder inside the run that is a link is refused, and one
replaced since it was checked, by its device and inode), under the run's lock (:func:`held`). Only the folders the
user names (the run folder, ``--out``) may be links. Reading a run imports no code that its
configuration names unless asked to (``trust_code``, :func:`check_code`), and reads its data folder only from an
absolute path outside the run folder (``evaluate.loading.load_learner``).

Its modules, one idea each, from the ground up (each imports only those above it in this list):

    layout       the names of a run's files, the limits on reading them, the run folder that holds a folder
    beneath      a regular file below a folder's descriptor, through no link (openat2 where the kernel has it)
    opened       the folders this process holds open for reading, whose descriptors the reads below them start from
    locking      the run's lock (flock) and its descriptor of the run folder, let go in a forked child
    opening      the rule of every read: from the run folder's descriptor, up to a limit in bytes
    folders      the folders written into: checked once, reached by a descriptor from the run folder
    temporaries  the temporary files a writer makes, and those a killed writer left
    commit       a set of files written all or none (save_together)
    appending    log.jsonl and conflict.jsonl: whole lines, cut back to a checkpoint's step on resume
    artefacts    reading what a run wrote: its log, its eval.json, its checkpoint
    reading      a run folder opened once by a reader of several of its files (RunFolder)
    claiming     claiming a folder for a run, undoing the claim, moving an earlier run aside
    trust        which code a run's configuration may import, and whose a file is

Every name is imported from here (``bayesncl_pyro.rundir``), not from the module that holds it.
"""

from bayesncl_pyro.rundir.appending import append_line, cut_records
from bayesncl_pyro.rundir.artefacts import load_checkpoint, read_eval, read_log
from bayesncl_pyro.rundir.claiming import claim, differences, holds_a_run, move_aside, unclaim
from bayesncl_pyro.rundir.commit import (
    Content,
    atomic_save,
    cannot_write,
    json_bytes,
    save_figure,
    save_together,
    write_json,
)
from bayesncl_pyro.rundir.folders import inner_folder, output_folder
from bayesncl_pyro.rundir.layout import (
    BAD_IMAGES,
    CHECKPOINT,
    CONFIG,
    CONFLICT,
    DATA_LIMIT,
    EVAL,
    GATES_FILE,
    INSPECT_DIR,
    JSON_LIMIT,
    LOCK,
    LOG,
    MARKER,
    MAX_LINE,
    MAX_RECORDS,
    NOVELTY,
    NOVELTY_ROC,
    PREVIOUS,
    REPORT_DIR,
    TEXT_LIMIT,
    WANDB_DIR,
    check_not_a_run_file,
    is_run_file,
    run_folder,
    run_holding,
)
from bayesncl_pyro.rundir.locking import RunLock, held, lock
from bayesncl_pyro.rundir.opening import exists, open_file, read_bytes, read_config_file, read_json, read_records
from bayesncl_pyro.rundir.reading import RunFolder
from bayesncl_pyro.rundir.trust import check_code, check_config_code, code_references, written_elsewhere

__all__ = [
    "BAD_IMAGES", "CHECKPOINT", "CONFIG", "CONFLICT", "Content", "DATA_LIMIT", "EVAL", "GATES_FILE", "INSPECT_DIR",
    "JSON_LIMIT", "LOCK", "LOG", "MARKER", "MAX_LINE", "MAX_RECORDS", "NOVELTY", "NOVELTY_ROC", "PREVIOUS",
    "REPORT_DIR", "RunFolder", "RunLock", "TEXT_LIMIT", "WANDB_DIR", "append_line", "atomic_save", "cannot_write",
    "check_code", "check_config_code", "check_not_a_run_file", "claim", "code_references", "cut_records", "differences",
    "exists", "held", "holds_a_run", "inner_folder", "is_run_file", "json_bytes", "load_checkpoint", "lock",
    "move_aside", "open_file", "output_folder", "read_bytes", "read_config_file", "read_eval", "read_json", "read_log",
    "read_records", "run_folder", "run_holding", "save_figure", "save_together", "unclaim", "write_json",
    "written_elsewhere",
]
