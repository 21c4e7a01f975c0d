"""Tests of the `sync_metrics` plugin.

The 2-process runs (torchrun, gloo, CPU) are launched once per module, with and without the plugin, from
tests/plugins/scripts/sync_metrics_dpo.py and sync_metrics_online_dpo.py. Every value they log is then recomputed in
this (single) process by stock TRL over exactly the real pairs of the logging window, with the policy weights of that
window, and compared at fp32 tolerance. Which pairs are real is derived here from accelerate's documented rule (the
first `remainder` samples of the rank-major last batch), independently of the plugin, and checked: the real pairs of
an epoch are exactly the dataset's pairs.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trl_ext
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

SCRIPTS = Path(__file__).parent / "scripts"
WORLD = 2
RTOL, ATOL = 2e-5, 2e-5

# The data layout of scripts/sync_metrics_dpo.py: 9 training pairs, 2 per rank and micro-batch, 2 epochs.
DPO_TRAIN_PAIRS, DPO_BATCH = 9, 2
DPO_EVALS = {"eval3": 3, "eval1": 1}
ONLINE_PROMPTS, ONLINE_BATCH = 5, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, out: Path, which: str) -> dict[str, list[dict]]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TQDM_DISABLE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        DS_ACCELERATOR="cpu",
        PYTHONWARNINGS="ignore",
    )
    env.pop("TRL_EXT_SYNC_METRICS", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(WORLD),
        "--master_port",
        str(_free_port()),
        str(SCRIPTS / script),
        str(out),
        which,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"{script} {which} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    modes = ("stock", "plugin") if which == "both" else (which,)
    return {m: [torch.load(out / f"{m}.rank{r}.pt", weights_only=False) for r in range(WORLD)] for m in modes}


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    """Stock TRL, then the plugin, in one 2-process launch."""
    return _launch("sync_metrics_dpo.py", tmp_path_factory.mktemp("sync_metrics_dpo"), "both")


@pytest.fixture(scope="module")
def online_runs(tmp_path_factory):
    return _launch("sync_metrics_online_dpo.py", tmp_path_factory.mktemp("sync_metrics_online"), "both")


def _real(remainder: int | None, rank: int, n: int) -> int:
    """accelerate's rule (accelerator.py `gather_for_metrics`): the first `remainder` samples of the rank-major
    concatenation of the last batch are real."""
    if remainder is None:
        return n
    return min(max(remainder - rank * n, 0), n)


def _close(actual: float, expected: float, atol: float = ATOL) -> bool:
    return math.isclose(actual, expected, rel_tol=RTOL, abs_tol=atol)


def _mismatches(got: dict, expected: dict, prefix: str = "", beta: float = 0.1) -> dict:
    """Metrics that differ beyond fp32 noise. DPO rewards are `beta * (logps - ref_logps)` of sums of ~100 token
    log-probs: fp32 sums in batches of other shapes differ by ~1e-6 of |logps|, which the subtraction keeps, so their
    absolute tolerance scales with the log-prob magnitudes (still ~100x below any weighting or duplicate error
    here)."""
    bad = {}
    scale = beta * (
        abs(expected.get(f"{prefix}logps/chosen", 0.0)) + abs(expected.get(f"{prefix}logps/rejected", 0.0))
    )
    for key, want in expected.items():
        rewards = key[len(prefix) :] in ("rewards/chosen", "rewards/rejected", "rewards/margins")
        atol = max(ATOL, 1e-5 * scale) if rewards else ATOL
        if not _close(got[key], want, atol):
            bad[key] = (got[key], want)
    return bad


def _assert_same_on_all_ranks(runs):
    logs = [[entry for entry in run["logs"]] for run in runs]
    assert all(len(lg) == len(logs[0]) for lg in logs)
    for entries in zip(*logs, strict=True):
        metric_keys = [
            {k: v for k, v in e[-1].items() if "runtime" not in k and "per_second" not in k} for e in entries
        ]
        assert all(m == metric_keys[0] for m in metric_keys), entries


# ---------------------------------------------------------------------------------------------------------------------
# DPO: single-process reference
# ---------------------------------------------------------------------------------------------------------------------


def _dpo_real_batches(runs):
    """{window: [(inputs, k), ...]} for every rank's batches; window is the optimizer step or the eval name."""
    windows: dict = {}
    for rank, run in enumerate(runs):
        train = [b for b in run["batches"] if b["phase"] == "train"]
        per_epoch = math.ceil(DPO_TRAIN_PAIRS / (WORLD * DPO_BATCH))
        remainder = DPO_TRAIN_PAIRS % (WORLD * DPO_BATCH) or None
        for i, batch in enumerate(train):
            last = i % per_epoch == per_epoch - 1
            k = _real(remainder if last else None, rank, batch["inputs"]["input_ids"].shape[0] // 2)
            windows.setdefault(batch["step"], []).append((batch["inputs"], k))
        for name, n in DPO_EVALS.items():
            evals = [b for b in run["batches"] if b["phase"] == name]
            assert len(evals) == 1  # every eval set here fits in one batch per rank
            b = evals[0]["inputs"]
            windows.setdefault(name, []).append(
                (b, _real(n % (WORLD * DPO_BATCH) or None, rank, b["input_ids"].shape[0] // 2))
            )
    return windows


def _union(parts):
    """One right-padded DPO batch ([chosen rows; rejected rows]) of the first k pairs of each part."""
    chosen, rejected = {}, {}
    for inputs, k in parts:
        n = inputs["input_ids"].shape[0] // 2
        for key in ("input_ids", "attention_mask", "completion_mask"):
            for row in range(k):
                for dest, r in ((chosen, row), (rejected, n + row)):
                    t = inputs[key][r]
                    length = int(inputs["attention_mask"][r].sum())
                    assert inputs["attention_mask"][r][:length].all()  # TRL's collator pads on the right
                    dest.setdefault(key, []).append(t[:length])
    width = max(len(t) for t in chosen["input_ids"] + rejected["input_ids"])
    out = {}
    for key in ("input_ids", "attention_mask", "completion_mask"):
        rows = chosen[key] + rejected[key]
        out[key] = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in rows])
    return out


def _expected_dpo_metrics(runs, out_dir, weights):
    """Expected logged metrics per window, computed by a stock single-process DPOTrainer on the window's real pairs
    with the policy weights of the window (`weights[window]`, or the initial weights when `weights` is None)."""
    from trl import DPOConfig, DPOTrainer

    from trl_ext.testing import make_tokenizer

    windows = _dpo_real_batches(runs)
    args = DPOConfig(
        output_dir=str(out_dir),
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = DPOTrainer(
        model=make_model(seed=0),
        ref_model=make_model(seed=1),  # as in the script: a reference that differs from the policy (no reward ties)
        args=args,
        train_dataset=make_preference_dataset(4, seed=1),
        processing_class=make_tokenizer(),
    )
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    expected, total_tokens, epoch_pairs = {}, 0, {}
    for window, parts in windows.items():
        batch = _union(parts)
        if isinstance(window, int):
            total_tokens += int(batch["attention_mask"].sum())
            rows = {tuple(r.tolist()) for r in batch["input_ids"][: batch["input_ids"].shape[0] // 2]}
            epoch_pairs.setdefault(window // 2, []).extend(rows)  # 2 optimizer steps per epoch
        trainer.model.load_state_dict(initial if weights is None else weights[window])
        mode = "train" if isinstance(window, int) else "eval"
        trainer.model.train(mode == "train")
        trainer._metrics[mode].clear()
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, batch, False)
        values = {key: vals[-1] for key, vals in trainer._metrics[mode].items() if key != "num_tokens"}
        values["num_tokens"] = total_tokens
        if mode == "train":
            values["loss"] = float(loss)  # the mean DPO loss over the window's real pairs
        expected[window] = values
    # The real pairs of each epoch are the dataset's 9 pairs, each once: the duplicate rule above is right.
    for rows in epoch_pairs.values():
        assert len(rows) == len(set(rows)) == DPO_TRAIN_PAIRS
    return expected


@pytest.fixture(scope="module")
def dpo_reference(dpo_runs, tmp_path_factory):
    runs = dpo_runs["plugin"]
    return _expected_dpo_metrics(runs, tmp_path_factory.mktemp("ref"), runs[0]["weights"])


def _check_train_logs(runs, expected_by_window):
    _assert_same_on_all_ranks(runs)
    train_logs = [(step, entry) for step, mode, entry in runs[0]["logs"] if "loss" in entry]
    assert [step for step, _ in train_logs] == [1, 2, 3, 4]
    for step, entry in train_logs:
        expected = expected_by_window[step - 1]
        # `loss` too: on the last step of each epoch (steps 2 and 4: 1 real pair, 3 duplicates), the mean over the
        # real pair only (issue 15, point 5); stock logs the mean over the duplicates as well.
        got = {k: v for k, v in entry.items() if k not in ("grad_norm", "learning_rate", "epoch")}
        assert set(got) == set(expected), (step, sorted(got), sorted(expected))
        bad = _mismatches(got, expected)
        assert not bad, f"step {step}: logged vs single-process reference {bad}"
    # Windows 2 and 4 hold 1 real pair (rank 0) and none on rank 1: a rank with no pairs still syncs.
    final = [entry for _, mode, entry in runs[0]["logs"] if "train_runtime" in entry]
    assert len(final) == 1 and "rewards/chosen" not in final[0]  # nothing left over after the last logging step
    # `train_loss` is the Trainer's mean of the logged step losses, so it counts real pairs only as well.
    step_losses = [expected_by_window[step - 1]["loss"] for step, _ in train_logs]
    assert _close(final[0]["train_loss"], sum(step_losses) / len(step_losses)), (final[0], step_losses)


def _check_eval_logs(runs, expected_by_window):
    evals = [entry for _, mode, entry in runs[0]["logs"] if "eval_loss" in entry]
    assert len(evals) == len(DPO_EVALS)
    last_train = max(k for k in expected_by_window if isinstance(k, int))
    for name, entry in zip(DPO_EVALS, evals, strict=True):
        expected = {f"eval_{k}": v for k, v in expected_by_window[name].items()}
        expected["eval_num_tokens"] = expected_by_window[last_train]["num_tokens"]
        got = {k: v for k, v in entry.items() if k in expected or k.startswith("eval_") and "/" in k}
        assert set(got) == set(expected)
        bad = _mismatches(got, expected, prefix="eval_")
        assert not bad, f"{name}: logged vs single-process reference {bad}"


@pytest.mark.distributed
def test_dpo_train_metrics_equal_single_process(dpo_runs, dpo_reference):
    _check_train_logs(dpo_runs["plugin"], dpo_reference)


@pytest.mark.distributed
def test_dpo_eval_metrics_equal_single_process(dpo_runs, dpo_reference):
    """Evaluation of 3 pairs (rank 1: 1 real pair, 1 duplicate) and of 1 pair (smaller than the world size)."""
    _check_eval_logs(dpo_runs["plugin"], dpo_reference)


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_dpo_zero3_no_deadlock_and_exact(tmp_path):
    """Under DeepSpeed ZeRO-3 the forward of the epoch-end real rows gathers parameters, so every rank must run it;
    the run completes and every value equals the single-process recomputation (learning rate 0: initial weights)."""
    runs = _launch("sync_metrics_dpo.py", tmp_path, "zero3")["zero3"]
    expected = _expected_dpo_metrics(runs, tmp_path / "ref", None)
    _check_train_logs(runs, expected)
    _check_eval_logs(runs, expected)


@pytest.mark.distributed
def test_dpo_loss_and_gradients_identical_to_stock(dpo_runs):
    """Same gradient norms and trained weights as stock TRL (training keeps accelerate's duplicates); the training
    loss and FLOs that the plugin folds into its collective equal transformers' own gathers, except the loss of the
    last step of each epoch, which counts the real pairs only (its value is checked against the single-process
    reference in `test_dpo_train_metrics_equal_single_process`)."""
    plugin, stock = dpo_runs["plugin"][0], dpo_runs["stock"][0]
    keys = ("grad_norm", "learning_rate", "eval_loss")
    seq = lambda run: [{k: e[k] for k in keys if k in e} for _, _, e in run["logs"]]  # noqa: E731
    assert seq(plugin) == seq(stock)
    losses = lambda run: {step: e["loss"] for step, _, e in run["logs"] if "loss" in e}  # noqa: E731
    assert sorted(losses(plugin)) == sorted(losses(stock)) == [1, 2, 3, 4]
    epoch_ends = (2, 4)  # 1 real pair and 3 duplicates
    for step in (1, 3):
        assert losses(plugin)[step] == losses(stock)[step]
    for step in epoch_ends:
        assert abs(losses(plugin)[step] - losses(stock)[step]) > 1e-3  # stock counts the duplicates
    final = lambda run: next(e for _, _, e in run["logs"] if "train_loss" in e)  # noqa: E731
    # train_loss is the mean of the logged step losses, in both.
    shift = sum(losses(plugin)[s] - losses(stock)[s] for s in epoch_ends) / 4
    assert math.isclose(final(plugin)["train_loss"], final(stock)["train_loss"] + shift, rel_tol=1e-6)
    assert plugin["total_flos"] == stock["total_flos"] > 0
    for name, value in plugin["final_params"].items():
        torch.testing.assert_close(value, stock["final_params"][name], rtol=0, atol=0)


def _phase_counts(events):
    """Collectives per optimizer step, per training logging step (loss gather + metrics) and inside each `log`."""
    per_step, per_logging_step, in_log = [], [], []
    last = {}
    for name, _step, count, *_ in events:
        if name == "step_begin":
            last["begin"] = count
        elif name == "step_end":
            per_step.append(count - last.pop("begin"))
            last["end"] = count
        elif name == "log_enter":
            last["enter"] = count
        elif name == "log_exit":
            in_log.append(count - last.pop("enter"))
            if "end" in last:
                per_logging_step.append(count - last.pop("end"))
    return per_step, per_logging_step, in_log


@pytest.mark.distributed
def test_collectives_per_step_and_per_log(dpo_runs):
    for rank in range(WORLD):
        p_step, p_logstep, p_in_log = _phase_counts(dpo_runs["plugin"][rank]["events"])
        s_step, s_logstep, s_in_log = _phase_counts(dpo_runs["stock"][rank]["events"])
        assert len(p_step) == len(s_step) == 4
        # Stock TRL: 15 gathers per training micro-step (2 per optimizer step here, 1 in the last of each epoch).
        assert s_step == [30, 15, 30, 15], s_step
        assert p_step == [0, 0, 0, 0], p_step
        # One collective in every `log` (4 train logs, the final summary, 2 evaluations), stock has none there.
        assert p_in_log == [1] * 7 and s_in_log == [0] * 7, (p_in_log, s_in_log)
        # A whole training logging step: stock transformers gathers the loss and the FLOs (`nested_gather`,
        # `store_flos`); the plugin folds both into its one collective.
        assert p_logstep == [1, 1, 1, 1] and s_logstep == [2, 2, 2, 2], (p_logstep, s_logstep)
    assert dpo_runs["plugin"][0]["plugin_collectives"] == 7


# ---------------------------------------------------------------------------------------------------------------------
# OnlineDPO
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_online_dpo_metrics_equal_single_process(online_runs, tmp_path):
    """Replay each rank's recorded completions (real prompts only) through a single-process stock OnlineDPOTrainer
    with the step's weights; the window's value is the pair-weighted mean over ranks (every rank's batch contributes
    k pairs and 2k completions, so pair- and completion-weighting coincide)."""
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from trl_ext.testing import make_tokenizer

    runs = online_runs["plugin"]
    _assert_same_on_all_ranks(runs)
    args = OnlineDPOConfig(
        output_dir=str(tmp_path / "ref"),
        per_device_train_batch_size=ONLINE_BATCH,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        max_new_tokens=6,
        missing_eos_penalty=1.0,
        seed=0,
    )
    trainer = OnlineDPOTrainer(
        model=make_model(seed=0),
        ref_model=make_model(seed=0),
        reward_funcs=length_reward,
        args=args,
        train_dataset=make_prompt_dataset(2, seed=3),
        processing_class=make_tokenizer(),
    )
    trainer.ref_model.load_state_dict(runs[0]["ref_weights"])
    remainder = ONLINE_PROMPTS % (WORLD * ONLINE_BATCH)
    steps_per_epoch = math.ceil(ONLINE_PROMPTS / (WORLD * ONLINE_BATCH))
    expected: dict[int, dict] = {}
    eos_seen = set()
    for rank, run in enumerate(runs):
        for i, rec in enumerate(run["steps"]):
            B = len(rec["prompts"])
            k = _real(remainder if i % steps_per_epoch == steps_per_epoch - 1 else None, rank, B)
            if k == 0:
                continue
            rows = torch.cat([torch.arange(k), torch.arange(B, B + k)])
            generated = tuple(t[rows] if isinstance(t, torch.Tensor) else t for t in rec["generated"])
            eos_seen.update(bool((g == 1).any()) for g in generated[2])
            trainer.model.load_state_dict(runs[0]["weights"][rec["step"]])
            trainer._generate = lambda *a, _g=generated, **kw: _g
            for key in trainer.stats:
                trainer.stats[key] = []
            loss = trainer.training_step(trainer.model, {"prompt": rec["prompts"][:k]})
            acc = expected.setdefault(rec["step"] + 1, {})
            for key, value in [(key, values[-1]) for key, values in trainer.stats.items()] + [("loss", float(loss))]:
                s, n = acc.get(key, (0.0, 0))
                acc[key] = (s + value * k, n + k)
    assert eos_seen == {True, False}  # some completions end with EOS and some do not
    logs = [(step, entry) for step, entry in runs[0]["logs"] if "loss" in entry]
    assert [step for step, _ in logs] == sorted(expected) == [1, 2]
    for step, entry in logs:
        want = {key: s / n for key, (s, n) in expected[step].items()}
        # `loss` too, on the last step (1 real prompt, 3 duplicates) as well: the mean over real pairs. TRL rounds
        # OnlineDPO's logged loss to 4 decimals.
        assert abs(entry["loss"] - want.pop("loss")) <= 0.5e-4 + 1e-6, (step, entry["loss"])
        got = {k: v for k, v in entry.items() if k not in ("loss", "grad_norm", "learning_rate", "epoch")}
        assert set(got) == set(want)
        bad = {k: (got[k], want[k]) for k in want if not _close(got[k], want[k])}
        assert not bad, f"step {step}: logged vs single-process replay {bad}"


@pytest.mark.distributed
def test_online_dpo_loss_identical_and_collectives(online_runs):
    plugin, stock = online_runs["plugin"], online_runs["stock"]
    seq = lambda run: [(s, e["loss"], e["grad_norm"]) for s, e in run["logs"] if "loss" in e]  # noqa: E731
    (p1, p2), (s1, s2) = seq(plugin[0]), seq(stock[0])
    # Training is stock's (same gradients); the logged loss is stock's except on the epoch's last step (step 2: one
    # real prompt, three duplicates), where it counts the real pair only (checked against a replay above).
    assert p1 == s1 and p2[0] == s2[0] and p2[2] == s2[2], (p1, s1, p2, s2)
    assert abs(p2[1] - s2[1]) > 1e-3, (p2, s2)  # stock averages over the duplicates
    final = lambda run: next(e for _, e in run["logs"] if "train_loss" in e)  # noqa: E731
    shift = (p2[1] - s2[1]) / 2  # train_loss is the mean of the two steps' losses (unrounded, so within rounding)
    assert abs(final(plugin[0])["train_loss"] - (final(stock[0])["train_loss"] + shift)) <= 1e-4
    assert plugin[0]["total_flos"] == stock[0]["total_flos"]  # 0 here: OnlineDPO batches have no `input_ids`
    for rank in range(WORLD):
        p_step, p_logstep, p_in_log = _phase_counts(plugin[rank]["events"])
        s_step, _, _ = _phase_counts(stock[rank]["events"])
        assert p_step == [0, 0] and s_step == [10, 10], (p_step, s_step)
        assert p_in_log == [1, 1, 1] and p_logstep == [1, 1], (p_in_log, p_logstep)
    # Stock logs `val/contain_eos_token` per rank (TRL bug); with the plugin every rank logs the same value.
    vals = [[e.get("val/contain_eos_token") for _, e in run["logs"] if "loss" in e] for run in plugin]
    assert vals[0] == vals[1]


# ---------------------------------------------------------------------------------------------------------------------
# In-process: single rank, configuration, refusals, uninstall
# ---------------------------------------------------------------------------------------------------------------------


class _LogRecorder:
    """A transformers callback (duck-typed) that keeps every `on_log` dict."""

    def __init__(self):
        self.logs = []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_single_process_equals_stock(dpo_args, tokenizer):
    """World size 1, one micro-batch per log: the plugin's values are TRL's own (both are means over one batch)."""
    from trl import DPOTrainer

    def run(plugin: bool):
        installation = trl_ext.install(sync_metrics=True) if plugin else None
        try:
            trainer = DPOTrainer(
                model=make_model(seed=0),
                ref_model=make_model(seed=0),
                args=dpo_args(max_steps=2, per_device_train_batch_size=3),
                train_dataset=make_preference_dataset(6, seed=2),
                processing_class=tokenizer,
            )
            recorder = _LogRecorder()
            trainer.add_callback(recorder)
            trainer.train()
            return [entry for entry in recorder.logs if "loss" in entry]
        finally:
            if installation is not None:
                installation.uninstall()

    plugin, stock = run(True), run(False)
    assert len(plugin) == len(stock) == 2
    for p, s in zip(plugin, stock, strict=True):
        assert set(p) == set(s)
        for key in s:
            assert _close(p[key], s[key]), (key, p[key], s[key])


def test_unknown_option_is_refused():
    with pytest.raises(trl_ext.UsageError, match="sync_metrics` has no options"):
        trl_ext.install(sync_metrics=True, plugins={"sync_metrics": {"every": 2}})


def test_env_flag_enables(monkeypatch, dpo_args, tokenizer):
    from trl import DPOTrainer

    monkeypatch.setenv("TRL_EXT_SYNC_METRICS", "1")
    with trl_ext.install() as installation:
        assert "sync_metrics" in installation.enabled_plugins("DPOTrainer")
        assert "sync_metrics" in installation.enabled_plugins("OnlineDPOTrainer")
        trainer = DPOTrainer(
            model=make_model(seed=0),
            ref_model=make_model(seed=0),
            args=dpo_args(),
            train_dataset=make_preference_dataset(4),
            processing_class=tokenizer,
        )
        assert "sync_metrics" in trainer._trl_ext.state


def test_liger_refused_on_logits_trl(dpo_args, tokenizer):
    """TRL < 1.15 runs a Liger loss whose logits metrics are per-batch means: refused. TRL >= 1.15 runs Liger through
    the same fused `_compute_loss`, so the plugin accepts it (TRL itself may then fail on the missing package)."""
    from trl import DPOTrainer

    from trl_ext import _compat

    with trl_ext.install(sync_metrics=True):
        build = lambda: DPOTrainer(  # noqa: E731
            model=make_model(seed=0),
            ref_model=make_model(seed=0),
            args=dpo_args(use_liger_kernel=True),
            train_dataset=make_preference_dataset(4),
            processing_class=tokenizer,
        )
        if _compat.dpo_uses_fused_lm_head():
            try:
                build()
            except trl_ext.UsageError:  # pragma: no cover - the assertion below reports it
                pytest.fail("sync_metrics refused use_liger_kernel on a fused-LM-head TRL")
            except Exception:
                pass  # TRL's own error (liger-kernel is not installed here)
        else:
            with pytest.raises(trl_ext.UsageError, match="use_liger_kernel"):
                build()


def test_vllm_refused(online_dpo_args, tokenizer):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    with trl_ext.install(sync_metrics=True):
        args = online_dpo_args()
        args.use_vllm = True  # set after construction: the config would check that vLLM is installed
        with pytest.raises(trl_ext.UsageError, match="use_vllm"):
            OnlineDPOTrainer(
                model=make_model(seed=0),
                reward_funcs=length_reward,
                args=args,
                train_dataset=make_prompt_dataset(4),
                processing_class=tokenizer,
            )


def test_uninstall_restores_trainer(dpo_args, online_dpo_args, tokenizer):
    from trl import DPOTrainer
    from trl.experimental.online_dpo import OnlineDPOTrainer

    installation = trl_ext.install(sync_metrics=True)
    dpo = DPOTrainer(
        model=make_model(seed=0),
        ref_model=make_model(seed=0),
        args=dpo_args(),
        train_dataset=make_preference_dataset(4),
        processing_class=tokenizer,
    )
    online = OnlineDPOTrainer(
        model=make_model(seed=0),
        ref_model=make_model(seed=0),
        reward_funcs=length_reward,
        args=online_dpo_args(),
        train_dataset=make_prompt_dataset(4),
        processing_class=tokenizer,
    )
    patched = {
        dpo: ("_compute_loss", "get_batch_samples"),
        online: ("training_step", "_forward", "_generate", "_calculate_rewards_from_functions", "get_batch_samples"),
    }
    for trainer, attrs in patched.items():
        assert all(a in trainer.__dict__ for a in attrs)
        assert "gather" in trainer.accelerator.__dict__ and "gather_for_metrics" in trainer.accelerator.__dict__
    installation.uninstall()
    for trainer, attrs in patched.items():  # the trainers keep their plugins after uninstall() (issue 15)
        assert all(a in trainer.__dict__ for a in attrs)
    installation.detach()
    for trainer, attrs in patched.items():
        assert not any(a in trainer.__dict__ for a in attrs)
        assert (
            "gather" not in trainer.accelerator.__dict__ and "gather_for_metrics" not in trainer.accelerator.__dict__
        )
        assert "_trl_ext" not in trainer.__dict__


def test_schema_reduce_mean_max_min():
    """The packed layout and the reduction of a gathered [world, size] matrix (sum/count means, min/max over ranks
    that saw the metric, metrics no rank saw are dropped)."""
    from trl_ext.plugins.sync_metrics.capture import Metric, Schema, Window

    schema = Schema([Metric("b"), Metric("a", "max"), Metric("c", "min"), Metric("d")])
    assert [m.name for m in schema.metrics] == ["a", "b", "c", "d"]
    rows = []
    for rank_items in (
        [
            (schema.sum_slot("b"), torch.tensor(3.0)),
            (schema.count_slot("b"), 2),
            (schema.sum_slot("a"), 5.0),
            (schema.count_slot("a"), 1),
            (schema.calls, 1),
            (schema.tokens, torch.tensor(7)),
        ],
        [
            (schema.sum_slot("b"), 1.0),
            (schema.count_slot("b"), torch.tensor(2)),
            (schema.sum_slot("c"), -4.0),
            (schema.count_slot("c"), 1),
            (schema.calls, 1),
        ],
    ):
        window = Window(schema)
        window.add(rank_items)
        rows.append(window.pack(torch.device("cpu")))
    metrics, total = schema.reduce(torch.stack(rows))
    assert metrics == {"a": 5.0, "b": 1.0, "c": -4.0}
    assert total[schema.calls] == 2 and total[schema.tokens] == 7 and len(total) == schema.size


def test_float64_per_pair_metrics_keep_float64(dpo_args, tokenizer):
    """float64 models: the per-pair metrics (rewards, log-probs) are summed in float64 as stock's means are, not
    rounded to float32 first (a near-zero `rewards/chosen` was off by 5e-6 relative that way)."""
    from trl import DPOTrainer

    def run(plugin: bool) -> dict:
        with trl_ext.install(sync_metrics=True) if plugin else contextlib.nullcontext():
            trainer = DPOTrainer(
                model=make_model(seed=0, dtype=torch.float64),
                ref_model=make_model(seed=1, dtype=torch.float64),
                args=dpo_args(max_steps=1, per_device_train_batch_size=3, bf16=False),
                train_dataset=make_preference_dataset(3, seed=2),
                processing_class=tokenizer,
            )
            trainer.train()
        return next(h for h in trainer.state.log_history if "loss" in h)

    from trl_ext import _compat

    # TRL's fused LM head (TRL >= 1.15) returns float32 log-probs even from a float64 model: stock's means are then
    # float32 means, the plugin's float64 sums of the same float32 values
    rel = 1e-6 if _compat.dpo_uses_fused_lm_head() else 1e-12
    plugin, stock = run(True), run(False)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert plugin[key] == pytest.approx(stock[key], rel=rel, abs=1e-15), key


def test_a_batch_entry_laid_out_neither_per_sequence_nor_per_pair_is_a_usage_error():
    """The real pairs of an epoch's uneven last batch are sliced from each entry by its layout; an entry of a custom
    collator laid out otherwise is the user's setting, refused with its fix."""
    from trl_ext import UsageError
    from trl_ext.plugins.sync_metrics.dpo import _slice_pairs

    batch = {"input_ids": torch.arange(8).view(4, 2), "ref_chosen_logps": torch.zeros(2), "trl_ext_index": None}
    sliced = _slice_pairs(batch, 1)  # 2 pairs -> the first: rows 0 and 2, one per-pair value, metadata dropped
    assert sliced["input_ids"].tolist() == [[0, 1], [4, 5]] and sliced["ref_chosen_logps"].shape == (1,)
    assert "trl_ext_index" not in sliced
    with pytest.raises(UsageError, match="'weights' is not laid out per sequence.*or disable sync_metrics"):
        _slice_pairs({**batch, "weights": torch.zeros(3)}, 1)


@pytest.mark.parametrize("how", ["detach", pytest.param("uninstall_detach", marks=pytest.mark.slow)])
def test_detach_in_the_middle_of_a_logging_window_keeps_its_metrics(dpo_args, tokenizer, how):
    """One logging window of 4 steps, the plugin detached after the second (`installation.detach(trainer)` or
    `uninstall(detach=True)`): the window's log equals stock's, every metric (it lost the batches before the detach,
    and `num_tokens` counted half the tokens)."""
    from transformers import TrainerCallback
    from trl import DPOTrainer

    def build():
        return DPOTrainer(
            model=make_model(seed=0),
            ref_model=make_model(seed=0),
            args=dpo_args(max_steps=4, logging_steps=4, per_device_train_batch_size=2),
            train_dataset=make_preference_dataset(8, seed=2),
            processing_class=tokenizer,
        )

    stock = build()
    stock.train()
    installation = trl_ext.install(sync_metrics=True)
    with installation:
        trainer = build()

    class Detach(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                installation.detach(trainer) if how == "detach" else installation.uninstall(detach=True)

    trainer.add_callback(Detach())
    trainer.train()
    assert getattr(trainer, "_trl_ext", None) is None
    (s_log,) = [log for log in stock.state.log_history if "loss" in log]
    (p_log,) = [log for log in trainer.state.log_history if "loss" in log]
    assert set(p_log) == set(s_log)
    for key, value in s_log.items():
        assert _close(p_log[key], value), (key, value, p_log[key])
