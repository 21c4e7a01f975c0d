"""The version matrix: on whatever TRL is installed, every built-in plugin trains two SGD steps in float64 on each
trainer it applies to, against stock TRL on the same data: every logged value and every trained weight equal (1e-6,
relative to `max(1, |value|)` and to each weight tensor's scale), or the plugin is refused before the first step with a
`UsageError` that names the TRL fact behind the refusal (`_compat.TRL_FACTS`), a fact the installed TRL is probed to
have.

Smoke size and one process, so that it runs on every TRL minor of the declared range: `.ci/run` runs the full suite on
two releases and this module alone on the others, each in an environment that differs only in TRL (docs/versions.md
has the resulting table). The terminal summary shows one line per (plugin, trainer).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import _compat
from trl_ext.errors import UsageError
from trl_ext.manager import builtin_plugin_modules
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

RTOL = 1e-6
TRL = _compat.installed_version("trl")

#: (plugin, trainer, trl-ext settings, TRL config settings of both runs): every built-in plugin on every trainer it
#: applies to (`generation` on Online DPO, without ZeRO-3: its pass-through path, as one process runs it).
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("padding_free", "dpo", {"padding_free": True}, {}),
    ("prompt_sharing", "dpo", {"prompt_sharing": True}, {}),
    ("prompt_sharing", "online", {"prompt_sharing": True}, {}),
    ("precompute_ref_batch_size", "dpo", {"precompute_ref_batch_size": 3}, {"precompute_ref_log_probs": True}),
    ("sync_metrics", "dpo", {"sync_metrics": True}, {}),
    ("sync_metrics", "online", {"sync_metrics": True}, {}),
    ("generation", "online", {"ds3_gather_for_generation": False}, {}),
    ("token_budget", "dpo", {"token_budget": 48}, {}),
    ("fused_logprobs", "dpo", {"fused_logprobs": True}, {}),
    ("fused_logprobs", "online", {"fused_logprobs": True}, {}),
]

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


def expected_refusal(plugin: str, trainer: str) -> _compat.TrlFact | None:
    """The TRL fact the installed TRL has that rules this (plugin, trainer) out, found by the library's probes."""
    if trainer == "dpo":
        fact = _compat.dpo_training_refusal()
        if fact is not None:
            return fact
        if plugin == "fused_logprobs" and not _compat.dpo_has_fused_head() and not _compat.dpo_logits_helpers():
            return _compat.DPO_UNKNOWN_LOGITS_HELPERS
    return None


def _dpo(dpo_args, tokenizer, **args: Any) -> Any:
    build = eq.dpo_builder(dpo_args, tokenizer, make_preference_dataset(8, seed=0), dtype=torch.float64)
    return build(optim="sgd", learning_rate=0.1, per_device_train_batch_size=4, **args)


def _online(online_dpo_args, tokenizer, **args: Any) -> Any:
    from trl.experimental.online_dpo import OnlineDPOTrainer

    args = online_dpo_args(bf16=False, optim="sgd", learning_rate=0.1, per_device_train_batch_size=2, **args)
    policy, ref = (eq.sharpen(make_model(seed=seed, dtype=torch.float64)) for seed in (0, 1))
    data = dict(train_dataset=make_prompt_dataset(4), processing_class=tokenizer)
    return OnlineDPOTrainer(model=policy, ref_model=ref, reward_funcs=length_reward, args=args, **data)


def _train(trainer_kind: str, fixtures: dict[str, Any], args: dict[str, Any]) -> Any:
    make = _dpo if trainer_kind == "dpo" else _online
    trainer = make(fixtures[f"{trainer_kind}_args"], fixtures["tokenizer"], **args)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def stock_runs() -> dict:
    """Stock trainers trained once per (trainer, TRL settings), or the exception stock TRL raised."""
    return {}


def _stock(stock_runs: dict, trainer_kind: str, fixtures: dict[str, Any], args: dict[str, Any]) -> Any:
    key = (trainer_kind, tuple(sorted(args.items())))
    if key not in stock_runs:
        try:
            stock_runs[key] = _train(trainer_kind, fixtures, args)
        except Exception as exc:  # noqa: BLE001 - stock TRL failing is a result here (e.g. TRL 1.15 on CPU)
            stock_runs[key] = exc
    return stock_runs[key]


def _logged(trainer: Any) -> list[dict[str, float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [{k: v for k, v in h.items() if not (k.endswith("runtime") or k.endswith("per_second"))} for h in logs]


def _worst_difference(stock: Any, other: Any) -> tuple[float, str]:
    """Assert every logged value (`|a - b| <= RTOL * max(1, |a|)`) and every trained weight (relative to the tensor's
    largest entry) equal; return the largest difference seen, and where."""
    stock_logs, other_logs = _logged(stock), _logged(other)
    assert len(stock_logs) == len(other_logs) == 2, (len(stock_logs), len(other_logs))
    worst = (0.0, "-")
    for step, (s, o) in enumerate(zip(stock_logs, other_logs, strict=True)):
        assert s.keys() == o.keys(), (step, sorted(set(s) ^ set(o)))
        for key, value in s.items():
            diff = abs(o[key] - value) / max(abs(value), 1.0)  # as `equivalence.max_rel`
            assert math.isfinite(o[key]) and diff <= RTOL, (step, key, value, o[key])
            worst = max(worst, (diff, key))
    assert stock.state.global_step == other.state.global_step == 2
    stock_weights = dict(stock.model.named_parameters())
    for name, value in other.model.named_parameters():
        reference = stock_weights[name]
        scale = reference.abs().max().item()
        diff = (value - reference).abs().max().item() / max(scale, 1e-12)
        assert diff <= RTOL, (name, diff)
        worst = max(worst, (diff, name))
    return worst


@pytest.fixture
def fixtures(dpo_args, online_dpo_args, tokenizer) -> dict[str, Any]:
    return {"dpo_args": dpo_args, "online_args": online_dpo_args, "tokenizer": tokenizer}


def test_cases_cover_every_builtin_plugin_on_each_of_its_trainers():
    from trl_ext.manager import load_catalog

    specs = load_catalog([])[0].specs
    kinds = {"DPOTrainer": "dpo", "OnlineDPOTrainer": "online"}
    expected = {
        (name, kinds[t]) for name in builtin_plugin_modules() for t in specs[name].trainers or kinds if t in kinds
    }
    assert {(plugin, trainer) for plugin, trainer, _, _ in CASES} == expected


# The two tests below are the version matrix proper (`.ci/run` runs tests/versions without a marker filter on every
# TRL release); on the installed TRL each plugin's own test files prove the same in the fast loop, so they are `slow`.
@pytest.mark.slow
@pytest.mark.parametrize("trainer_kind", ["dpo", "online"])
def test_stock_trains_unless_a_fact_says_it_cannot(trainer_kind, fixtures, stock_runs, report):
    """The facts the refusals name are real: stock TRL fails exactly where a probe says it cannot train."""
    stock = _stock(stock_runs, trainer_kind, fixtures, {})
    fact = expected_refusal("", trainer_kind)
    if fact is None:
        assert not isinstance(stock, Exception), f"stock {trainer_kind} failed on trl {TRL}: {stock!r}"
        assert all(math.isfinite(h["loss"]) for h in _logged(stock))
        report("version matrix", f"trl {TRL}: stock {trainer_kind}: trains")
    else:
        assert isinstance(stock, Exception), f"{fact.name} says stock {trainer_kind} cannot train, yet it did"
        report("version matrix", f"trl {TRL}: stock {trainer_kind}: fails ({fact.name}: {type(stock).__name__})")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plugin", "trainer_kind", "settings", "trl_args"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_plugin_equals_stock_or_is_refused_by_a_named_fact(
    plugin, trainer_kind, settings, trl_args, fixtures, stock_runs, report
):
    fact = expected_refusal(plugin, trainer_kind)
    with trl_ext.install(**settings):
        if fact is not None:
            with pytest.raises(UsageError) as refused:
                _train(trainer_kind, fixtures, trl_args)
            assert fact.name in str(refused.value)
            report("version matrix", f"trl {TRL}: {plugin} on {trainer_kind}: refused ({fact.name})")
            return
        try:
            trained = _train(trainer_kind, fixtures, trl_args)
        except UsageError as exc:
            named = [name for name in _compat.TRL_FACTS if name in str(exc)]
            report("version matrix", f"trl {TRL}: {plugin} on {trainer_kind}: REFUSED WITHOUT A PROBED FACT")
            pytest.fail(f"{plugin} refused on trl {TRL} ({named or 'no TRL fact named'}): {exc}")
        assert plugin in trained._trl_ext.enabled
    stock = _stock(stock_runs, trainer_kind, fixtures, trl_args)
    assert not isinstance(stock, Exception), f"stock {trainer_kind} failed on trl {TRL}: {stock!r}"
    worst, where = _worst_difference(stock, trained)
    report(
        "version matrix",
        f"trl {TRL}: {plugin} on {trainer_kind}: equal (largest difference {worst:.1e}: {where})",
    )


def test_doctor_names_the_dpo_layout_and_what_keeps_dpo_from_training(capsys):
    import argparse

    from trl_ext.app import cli

    code = cli._cmd_doctor(argparse.Namespace())
    out = capsys.readouterr().out
    layout = "TRL's fused LM head" if _compat.dpo_has_fused_head() else " + ".join(_compat.dpo_logits_helpers())
    assert (
        f"supported; DPO scoring: {'' if _compat.dpo_has_fused_head() else 'full logits, read through '}{layout}"
        in out
    )
    fact = _compat.dpo_training_refusal()
    if fact is None:
        assert "CANNOT TRAIN" not in out and code == 0, out
    else:
        assert f"DPOTrainer CANNOT TRAIN here: {fact.text}" in out and fact.name in out, out
        assert code == 1 and out.strip().endswith("PROBLEMS FOUND (see above)")
