import copy
import json

import pytest
import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.nn.optim import (
    LARS,
    WARMUP_START_LR,
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    load_scheduler_state,
    warmup_cosine,
)
from bayesncl_pyro.rundir import load_checkpoint, read_log
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer

# a tiny digits run: 2 epochs of 7 steps at batch 200
TINY = dict(dataset="digits", proj_hidden=64, proj_dim=32, batch_size=200, epochs=2, warmup_epochs=0.5,
            workers=0, log_every=1, ckpt_every=3)


def tiny(tmp_path, **kw):
    return Config(out=str(tmp_path / "run"), **{**TINY, **kw})


def _params(trainer):
    return {k: v.clone() for k, v in trainer.learner.state_dict().items()}


def test_digits_training_lowers_the_loss_and_keeps_gates_alive(tmp_path):
    cfg = tiny(tmp_path, epochs=12, warmup_epochs=1, lr=0.06, log_every=7)
    results = Trainer(cfg, progress=False).fit().evaluate()
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert log[-1]["loss"] < log[0]["loss"] - 0.1
    for key in ("step", "epoch", "lr", "loss", "nce", "kl", "gate_rate", "incl_min", "incl_max", "grad_norm",
                "images_per_s", "active"):
        assert key in log[-1]
    assert 0.05 < log[-1]["gate_rate"] < 0.995  # neither all dead nor all open
    assert results["linear_probe_top1"] > 0.5  # chance is 0.1
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    for key in ("semantic_consistency", "semantic_entropy", "activation_rate", "active_dims", "sparsity",
                "effective_rank", "linear_probe_top1", "linear_probe_top5", "knn_top1"):
        assert key in saved
        assert key == "active_dims" or key in ("semantic_entropy", "effective_rank") or 0 <= saved[key] <= 1


def test_resume_continues_exactly(tmp_path):
    """An interrupted run (max_steps) continued with the same command ends with the parameters of an
    uninterrupted run."""
    straight = Trainer(tiny(tmp_path / "a"), progress=False)
    straight.train(straight.total_steps)
    first = Trainer(tiny(tmp_path / "b", max_steps=9), progress=False)  # stops mid-epoch 2
    first.train(9)
    first.save()
    resumed = Trainer(tiny(tmp_path / "b"), progress=False)
    assert resumed.step == 9
    resumed.train(resumed.total_steps)
    a, b = _params(straight), _params(resumed)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_same_seed_same_numbers(tmp_path):
    runs = []
    for name in ("a", "b"):
        t = Trainer(tiny(tmp_path / name, max_steps=3), progress=False)
        t.train(3)
        runs.append(_params(t))
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=0, atol=0, msg=k)


def test_checkpoint_round_trip_and_finished_run_is_not_retrained(tmp_path, capsys):
    cfg = tiny(tmp_path, epochs=1, warmup_epochs=0)
    first = Trainer(cfg, progress=False).fit().evaluate()
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert ckpt["finished"] and ckpt["step"] == 7 and ckpt["config"]["proj_dim"] == 32
    learner, saved_cfg = load_learner(tmp_path / "run")
    assert saved_cfg == resolve(cfg)
    assert not learner.training
    before = (tmp_path / "run" / "checkpoint.pt").stat().st_mtime_ns
    again = Trainer(cfg, progress=False).fit().evaluate()
    assert again == first
    assert "already holds a finished run" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoint.pt").stat().st_mtime_ns == before


def test_folder_with_another_config_is_refused(tmp_path):
    Trainer(tiny(tmp_path, max_steps=1), progress=False).save()  # a checkpoint: a run to resume (else moved aside)
    with pytest.raises(UserError, match="different configuration.*temperature"):
        Trainer(tiny(tmp_path, temperature=0.5), progress=False)


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(prior_prob=1.0), "between 0 and 1"),
    (dict(batch_size=1), "at least 2"),
    (dict(topk=100), "--topk"),
    (dict(lr=-1.0), "--lr must be positive"),
    (dict(dataset="mnist"), "digits, cifar10"),
    (dict(prior="horseshoe"), "beta-bernoulli"),
    (dict(warmup_epochs=5), "shorter than --epochs"),
])
def test_impossible_configs_are_rejected(tmp_path, bad, match):
    with pytest.raises(UserError, match=match):
        resolve(tiny(tmp_path, **bad))


def test_batch_larger_than_the_data_is_rejected_and_leaves_nothing_that_blocks_the_corrected_run(tmp_path):
    with pytest.raises(UserError, match="larger than the training set"):
        Trainer(tiny(tmp_path, batch_size=5000), progress=False)
    assert not (tmp_path / "run").exists()  # the refused run undid its claim: no folder at all
    assert Trainer(tiny(tmp_path), progress=False).step == 0  # the corrected command is not "another configuration"


def test_schedule_warms_up_from_reference_start_then_cosine():
    assert warmup_cosine(0, 10, 100, 0.4) * 0.4 == pytest.approx(WARMUP_START_LR)
    assert warmup_cosine(10, 10, 100, 0.4) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.4) == pytest.approx(0.5)
    assert warmup_cosine(100, 10, 100, 0.4) == pytest.approx(0.0)


def test_lars_trust_ratio_and_excluded_biases():
    w = torch.nn.Parameter(torch.ones(2, 2))
    b = torch.nn.Parameter(torch.ones(2))
    w.grad, b.grad = torch.full((2, 2), 10.0), torch.full((2,), 10.0)
    LARS([w, b], lr=1.0, momentum=0.0, weight_decay=0.0, eta=0.02).step()
    # weight: step = lr * eta * ||w|| / ||g|| * g = 0.02 * 2 / 20 * 10 = 0.02; bias: plain SGD
    torch.testing.assert_close(w.detach(), torch.full((2, 2), 0.98))
    torch.testing.assert_close(b.detach(), torch.full((2,), -9.0))


def _lars_step_one_parameter_at_a_time(params, groups, state):
    """solo-learn's LARS step (exclude_bias_n_norm, no dampening, no Nesterov), parameter by parameter: the trust ratio
    and the weight decay only where both norms are positive, else the plain gradient."""
    for group in groups:
        wd, lr = group["weight_decay"], group["lr"]
        for p in group["params"]:
            if p.grad is None:
                continue
            d_p = p.grad
            p_norm, g_norm = p.norm(), d_p.norm()
            if p.ndim > 1 and p_norm != 0 and g_norm != 0:
                trust = group["eta"] * p_norm / (g_norm + wd * p_norm + group["eps"])
                if group["clip_lr"]:
                    trust = min(trust / lr, 1)
                d_p = d_p.add(p, alpha=wd) * trust
            if p not in state:
                state[p] = d_p.clone()
            else:
                state[p].mul_(group["momentum"]).add_(d_p)
            p.add_(state[p], alpha=-lr)


@pytest.mark.parametrize("clip_lr, lr_on_device", [(True, False), (False, False), (True, True)])
def test_lars_foreach_step_is_the_per_parameter_formula(clip_lr, lr_on_device):
    torch.manual_seed(0)
    shapes = [(8, 4, 3, 3), (8,), (8,), (16, 8), (16,), (5, 16), (3, 3)]
    made = [torch.randn(s) for s in shapes]
    made[-1].zero_()  # a zero weight: the plain gradient
    ours, theirs = [[torch.nn.Parameter(t.clone()) for t in made] for _ in range(2)]

    def groups(params, lr=float):  # a decayed group with a large lr (clipping bites), and one without decay
        return [dict(params=params[:5], lr=lr(2.0), weight_decay=1e-4),
                dict(params=params[5:], lr=lr(0.05), weight_decay=0.0)]

    opt = LARS(groups(ours, torch.tensor if lr_on_device else float), lr=0.1, momentum=0.9, clip_lr=clip_lr)
    reference = [dict(g, momentum=0.9, eta=0.02, clip_lr=clip_lr, eps=1e-8) for g in groups(theirs)]
    buffers = {}
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        grads[3].zero_()  # a zero gradient of a decayed weight: no step, no decay
        grads[5] *= 1e-3  # trust / lr > 1: clip_lr caps it
        for k, (a, b) in enumerate(zip(ours, theirs)):
            a.grad = b.grad = None if k == 2 and step == 1 else grads[k].clone()  # a step without a gradient
        opt.step()
        with torch.no_grad():
            _lars_step_one_parameter_at_a_time(theirs, reference, buffers)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.state[a]["momentum_buffer"], buffers[b], rtol=1e-6, atol=1e-7)


def test_learning_rates_on_the_device_follow_the_schedule_and_resume_as_either_kind():
    """--cuda-graphs' learning rates: tensors the schedule writes in place (what a CUDA graph of the step reads), with
    the values of the floats of a run without it; a checkpoint of either kind resumes into an optimizer of the other,
    which keeps its own kind."""
    def made(lr_on_device):
        groups = [dict(params=[torch.nn.Parameter(torch.ones(3, 2))], lr=0.4),
                  dict(params=[torch.nn.Parameter(torch.ones(2))], lr=0.1)]
        optimizer = build_optimizer("lars", groups, 0.9, 1e-6, lr_on_device=lr_on_device)
        return optimizer, build_scheduler(optimizer, 3, 10)

    (floats, floats_schedule), (tensors, tensors_schedule) = made(False), made(True)
    held = [g["lr"] for g in tensors.param_groups]
    for _ in range(5):
        for optimizer, schedule in ((floats, floats_schedule), (tensors, tensors_schedule)):
            optimizer.step()  # no gradients: no update
            schedule.step()
        assert [float(g["lr"]) for g in tensors.param_groups] == pytest.approx(
            [g["lr"] for g in floats.param_groups], rel=1e-6)
    assert all(g["lr"] is t for g, t in zip(tensors.param_groups, held, strict=True))
    resumed = []
    for saved, saved_schedule, lr_on_device in ((floats, floats_schedule, True), (tensors, tensors_schedule, False)):
        optimizer, schedule = made(lr_on_device)
        load_optimizer_state(optimizer, copy.deepcopy(saved.state_dict()))
        for group, their in zip(optimizer.param_groups, saved.param_groups, strict=True):
            assert torch.is_tensor(group["lr"]) == lr_on_device
            assert float(group["lr"]) == pytest.approx(float(their["lr"]), rel=1e-7)
        load_scheduler_state(schedule, copy.deepcopy(saved_schedule.state_dict()))
        assert all(type(lr) is float for lr in schedule.state_dict()["base_lrs"])
        resumed.append((optimizer, schedule))
    # the schedule goes on after the resume, and the rates keep the optimizer's kind (a checkpoint's device base
    # rates once made a resumed float optimizer's rates CPU tensors)
    for (optimizer, schedule), lr_on_device, saved in zip(resumed, (True, False), (floats, tensors)):
        schedule.step()
        assert all(torch.is_tensor(g["lr"]) == lr_on_device for g in optimizer.param_groups)
    floats_schedule.step()
    assert [float(g["lr"]) for g in resumed[0][0].param_groups] == pytest.approx(
        [g["lr"] for g in floats.param_groups], rel=1e-6)


def test_training_writes_the_conflict_diagnostic(tmp_path):
    trainer = Trainer(tiny(tmp_path, epochs=1, warmup_epochs=0, conflict_every=2), progress=False)
    trainer.train(5)
    conflict = [json.loads(line) for line in open(tmp_path / "run" / "conflict.jsonl")]
    assert [r["step"] for r in conflict] == [2, 4]
    assert all(len(r[k]) == 32 for r in conflict for k in ("pos", "neg", "freq", "incl"))


def test_degenerate_gates_are_warned_about_in_the_log(tmp_path, caplog):
    # a prior rate of 0.001 and a heavy KL weight shut every gate in one step
    # sampled gates: some stay open by chance, so the features are not all zero (STE's threshold would close all)
    cfg = tiny(tmp_path, epochs=1, warmup_epochs=0, prior_prob=0.001, kl_weight=1.0, gate_lr=1.0, gate="relaxed")
    Trainer(cfg, progress=False).train(2)
    first, second = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert "warnings" not in first
    assert any("closed" in w for w in second["warnings"]) and any("KL collapse" in w for w in second["warnings"])
    assert "warning: step 2: nearly all gates are closed" in caplog.text


def test_a_run_of_version_0_1_loads_and_resumes_as_it_was(tmp_path):
    """A 0.1 run folder (the learner's parts named encoder.*, model.*, guide.*; a config without kl_clamp,
    eval_protocol and prior_args; `gs` meaning the reference's loss) reloads with its weights and resumes with
    the command it was made with: the settings that reproduce what 0.1 computed fill what the config lacks."""
    first = Trainer(tiny(tmp_path, gate="gs-reference-kl", eval_protocol="fast", max_steps=4), progress=False)
    first.train(4)
    first.save()
    run = tmp_path / "run"
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    old = {"backbone.": "encoder.backbone.", "head.projector.": "encoder.projector.", "head.model.": "model.",
           "head.guide.": "guide."}
    state["learner"] = {next(o + k[len(n):] for n, o in old.items() if k.startswith(n)): v
                        for k, v in state["learner"].items()}
    config = {k: v for k, v in state["config"].items()
              if k not in ("kl_clamp", "eval_protocol", "prior_args", "ckpt_minutes", "tensorboard")}
    state.update(version="0.1.0", config=dict(config, gate="gs"))
    torch.save(state, run / "checkpoint.pt")
    (run / "config.json").write_text(json.dumps(dict(config, gate="gs")))

    learner, cfg = load_learner(run)
    assert cfg.gate == "gs-reference-kl" and cfg.eval_protocol == "fast" and cfg.kl_clamp == 0.01
    for k, v in first.learner.state_dict().items():
        torch.testing.assert_close(learner.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # the 0.1 command (--gate gs) now means another loss: the difference is named
    with pytest.raises(UserError, match="gate: 'gs-reference-kl' -> 'gs'"):
        Trainer(tiny(tmp_path, gate="gs", max_steps=6), progress=False)
    resumed = Trainer(tiny(tmp_path, gate="gs-reference-kl", eval_protocol="fast", max_steps=6), progress=False)
    assert resumed.step == 4
    resumed.train(6)


@pytest.mark.parametrize("optimizer", ["sgd", "lars", "adamw"])
def test_a_checkpoint_of_the_former_prior_learning_rate_resumes_as_it_was(tmp_path, optimizer):
    """Before the head divided the prior's gradients by lambda, its optimizer group ran at gate_lr / lambda on raw
    gradients (AdamW: at gate_lr); such a checkpoint resumes with its state in the current units, and trains on as
    a run that never stopped."""
    kw = dict(prior="learned", optimizer=optimizer, kl_weight=1e-3, warmup_epochs=0, lr=0.01)
    straight = Trainer(tiny(tmp_path / "a", max_steps=6, **kw), progress=False)
    straight.train(6)
    first = Trainer(tiny(tmp_path / "b", max_steps=3, **kw), progress=False)
    first.train(3)
    first.save()
    path = tmp_path / "b" / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    index, group = next((i, g) for i, g in enumerate(state["optimizer"]["param_groups"]) if g["name"] == "prior")
    assert group.pop("grad_scale") == pytest.approx(1e3)
    moments = [state["optimizer"]["state"][p] for p in group["params"]]
    if optimizer == "adamw":
        for m in moments:
            m["exp_avg"], m["exp_avg_sq"] = m["exp_avg"] * 1e-3, m["exp_avg_sq"] * 1e-6
    else:
        group["lr"], group["initial_lr"] = group["lr"] / 1e-3, group["initial_lr"] / 1e-3
        for m in moments:
            m["momentum_buffer"] = m["momentum_buffer"] * 1e-3
        for key in ("base_lrs", "_last_lr"):
            state["scheduler"][key][index] /= 1e-3
    torch.save(state, path)
    resumed = Trainer(tiny(tmp_path / "b", max_steps=6, **kw), progress=False)
    assert resumed.optimizer.param_groups[index]["lr"] == pytest.approx(first.optimizer.param_groups[index]["lr"])
    resumed.train(6)
    a, b = _params(straight), _params(resumed)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)


def test_the_logged_grad_norm_is_the_losss_with_the_prior_on_its_scale(tmp_path):
    """The prior's gradients arrive divided by lambda (for its step); the log's grad_norm puts them back on the
    loss's scale, where they are negligible, instead of letting them dominate it."""
    trainer = Trainer(tiny(tmp_path, prior="learned", kl_weight=1e-4, log_every=1), progress=False)
    trainer.train(1)
    learner = trainer.learner
    prior = {id(p) for p in learner.head.prior_parameters()}
    grads = {id(p): p.grad for p in learner.parameters() if p.grad is not None}
    assert prior and prior <= grads.keys()  # the step's gradients are still there
    loss_scale = torch.nn.utils.get_total_norm([g * 1e-4 if k in prior else g for k, g in grads.items()]).item()
    hooked = torch.nn.utils.get_total_norm(list(grads.values())).item()
    logged = read_log(tmp_path / "run")[-1]["grad_norm"]
    assert logged == pytest.approx(loss_scale, rel=1e-5) and hooked > logged * 1.01


def test_monitoring_logs_knn_and_rankme_every_few_epochs_and_changes_nothing_else(tmp_path):
    monitored = Trainer(tiny(tmp_path / "a", monitor_every=1, log_every=5), progress=False)
    monitored.train(monitored.total_steps)
    plain = Trainer(tiny(tmp_path / "b", monitor_every=0, log_every=5), progress=False)
    plain.train(plain.total_steps)
    a, b = _params(monitored), _params(plain)
    for k in a:  # no random stream, mode or BatchNorm statistic of the run is touched
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    log = read_log(tmp_path / "a" / "run")
    assert [r["step"] for r in log] == [5, 7, 10, 14]  # every 5 steps, and at an epoch's end (7 steps an epoch)
    for r in log:
        assert ("knn_top1" in r) == (r["step"] == 7)  # not at the last: the evaluation follows
    assert all(0 < r["knn_top1"] <= 1 and 1 <= r["rankme"] <= 32 for r in log if "knn_top1" in r)
    assert not any("knn_top1" in r for r in read_log(tmp_path / "b" / "run"))


def test_a_resumed_run_keeps_no_record_past_its_checkpoint(tmp_path):
    """A run killed after its checkpoint (it logged steps 7 and 8, and was cut short writing 9), rerun: its log.jsonl
    and conflict.jsonl hold what an uninterrupted run's do, each step once."""
    kw = dict(conflict_every=2, max_steps=10)
    Trainer(tiny(tmp_path / "a", **kw), progress=False).fit()
    killed = Trainer(tiny(tmp_path / "b", **kw), progress=False)
    killed.train(8)  # checkpoints at steps 3 and 6
    del killed  # its process ends: the run folder's lock goes with it
    with open(tmp_path / "b" / "run" / "log.jsonl", "a") as f:
        f.write('{"step": 9, "epo')  # the line a SIGKILL cut short
    Trainer(tiny(tmp_path / "b", **kw), progress=False).fit()

    def records(run, name):  # all but the clock's, and the thread count each process's first record states
        return [{k: v for k, v in json.loads(line).items() if k not in ("images_per_s", "num_threads")}
                for line in (tmp_path / run / "run" / name).read_text().splitlines()]

    assert [r["step"] for r in records("b", "log.jsonl")] == list(range(1, 11))
    assert [r["step"] for r in records("b", "conflict.jsonl")] == [2, 4, 6, 8, 10]
    for name in ("log.jsonl", "conflict.jsonl"):
        assert records("b", name) == records("a", name)
