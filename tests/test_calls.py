"""`trl_ext_call` (trl_ext/calls.py) on a real DPOTrainer: one wrapper per listed method, the chain in the order
`trl-ext plugins --order` prints, pass-through changes nothing, detach makes the trainer stock, bad lists refused."""

from __future__ import annotations

import pytest

import trl_ext
from trl_ext import UsageError
from trl_ext.app.cli import main as cli_main
from trl_ext.spec import PluginSpec
from trl_ext.testing import make_model, make_preference_dataset

from ._fakes import install_fake_plugin


class _Taker:
    """Takes part in `training_step` and `compute_loss`, recording each link's entry and exit in `events`."""

    def __init__(self, name: str, events: list, calls: tuple[str, ...], **opts) -> None:
        self.TRL_EXT_PLUGIN = PluginSpec(name=name, calls=calls)
        self.name = name
        self.events = events

        @trl_ext.hookimpl(**opts)
        def trl_ext_call(trainer, context, call):
            assert call.original.__self__ is trainer and call.original.__func__ is getattr(type(trainer), call.name)
            self.events.append((self.name, "enter", call.name))
            result = call.proceed()
            self.events.append((self.name, "exit", call.name))
            return result

        self.trl_ext_call = trl_ext_call


def _dpo(tokenizer, dpo_args):
    from trl import DPOTrainer

    return DPOTrainer(
        make_model("llama", seed=0),
        ref_model=make_model("llama", seed=0),
        args=dpo_args(max_steps=1),
        train_dataset=make_preference_dataset(8),
        processing_class=tokenizer,
    )


def _losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_the_chain_runs_in_the_printed_order_and_changes_nothing(tokenizer, dpo_args, monkeypatch, capsys):
    stock = _dpo(tokenizer, dpo_args)
    stock.train()
    events: list = []
    calls = ("training_step", "compute_loss")
    install_fake_plugin(monkeypatch, "outer", _Taker("outer", events, calls, tryfirst=True), "trl-ext-outer")
    install_fake_plugin(monkeypatch, "inner", _Taker("inner", events, calls[:1]), "trl-ext-inner")
    assert cli_main(["plugins", "--order"]) == 0
    printed = capsys.readouterr().out
    assert "  training_step: outer > inner > TRL\n" in printed and "  compute_loss: outer > TRL\n" in printed
    with trl_ext.install(plugins={"outer": {}, "inner": {}}) as installation:
        trainer = _dpo(tokenizer, dpo_args)
        assert {"training_step", "compute_loss"} <= set(trainer.__dict__)
        trainer.train()
    assert _losses(trainer) == _losses(stock) and len(_losses(stock)) == 1
    step = [e for e in events if e[2] == "training_step"]
    assert step == [
        ("outer", "enter", "training_step"),
        ("inner", "enter", "training_step"),
        ("inner", "exit", "training_step"),
        ("outer", "exit", "training_step"),
    ]
    # transformers' `training_step` calls `compute_loss` once, inside both links of the step's chain.
    first, last = events.index(step[1]), events.index(step[2])
    assert events[first + 1 : last] == [("outer", "enter", "compute_loss"), ("outer", "exit", "compute_loss")]
    installation.detach(trainer)
    assert not {"training_step", "compute_loss"} & set(trainer.__dict__)


def test_a_listed_method_the_trainer_lacks_is_refused_before_training(tokenizer, dpo_args, monkeypatch):
    plugin = _Taker("lister", [], ("DPOTrainer._no_such_method",))
    install_fake_plugin(monkeypatch, "lister", plugin, "trl-ext-lister")
    with trl_ext.install(plugins={"lister": {}}), pytest.raises(UsageError, match="no method `_no_such_method`"):
        _dpo(tokenizer, dpo_args)


def test_taking_part_without_listing_methods_is_refused(tokenizer, dpo_args, monkeypatch):
    install_fake_plugin(monkeypatch, "silent", _Taker("silent", [], ()), "trl-ext-silent")
    with trl_ext.install(plugins={"silent": {}}), pytest.raises(UsageError, match="lists no method"):
        _dpo(tokenizer, dpo_args)
