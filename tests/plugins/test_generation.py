"""Tests of the `generation` plugin: bounded-memory, exception-safe generation under DeepSpeed ZeRO-3.

The ZeRO-3 tests share one 2-process launch (`scripts/generation_zero3.py`, gloo on CPU) that trains a stock
`OnlineDPOTrainer` in every mode (stock TRL gather / no-gather, and trl-ext `True`, `False`, budget, `"auto"`) and
writes per-rank JSON; the tests below assert on it. The single-process tests cover the pass-through path (no ZeRO-3),
the configuration errors and the context manager's contract.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trl_ext
from tests import helpers
from trl_ext.errors import UsageError

SCRIPT = Path(__file__).parent / "scripts" / "generation_zero3.py"
USER_GC_KWARGS = helpers.USER_GC_KWARGS
BUDGET_FRACTION = 0.55  # as in the script
EXT_MODES = ("gather", "stream", "budget", "auto")
ALL_MODES = ("stock_gather", "stock_nogather", *EXT_MODES)
#: GRPO / RLOO (same helper): stock gather vs trl-ext's bounded no-gather.
OTHER_TRAINERS = {"grpo": ("grpo_stock_gather", "grpo_stream"), "rloo": ("rloo_stock_gather", "rloo_stream")}


# ---------------------------------------------------------------------------------------------------------------
# 2-process DeepSpeed ZeRO-3
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation_zero3")
    env = helpers.launch_env(TRL_EXT_LOG_LEVEL="info")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"launch failed (rc={proc.returncode}):\n{log[-6000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    return {"ranks": [r["modes"] for r in ranks], "log": log}


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_every_mode_trains_and_generates_like_stock_trl(zero3):
    for rank, modes in enumerate(zero3["ranks"]):
        reference = modes["stock_gather"]
        assert len(reference["completions"]) == 2 and len(reference["losses"]) == 2
        for name in ALL_MODES:
            got = modes[name]
            # Sampled completions of both training steps, the losses, greedy tokens after training and one more
            # engine step: all bit-identical, so no mode changes what is computed.
            assert got["completions"] == reference["completions"], (rank, name)
            assert got["losses"] == reference["losses"], (rank, name)
            assert got["greedy_tokens"] == reference["greedy_tokens"], (rank, name)
            assert got["engine_step_loss"] == reference["engine_step_loss"], (rank, name)
        for name in EXT_MODES:
            # 2 training steps + the greedy call went through the plugin's context, not TRL's.
            assert modes[name]["generations"] == 3, name
    # Greedy generation of the same prompts is identical on both ranks.
    assert zero3["ranks"][0]["stock_gather"]["greedy_tokens"] == zero3["ranks"][1]["stock_gather"]["greedy_tokens"]


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_resident_parameter_bytes_per_mode(zero3):
    for modes in zero3["ranks"]:
        ref = modes["stock_gather"]
        model, persistent = ref["model_bytes"], ref["persistent_bytes"]
        one_layer, one_module = max(ref["layer_bytes"]), ref["max_module_bytes"]
        assert one_module < one_layer < model / 4  # the tiny model is built so that the bounds below are distinct

        # Gathering modes hold the whole model, during training and after.
        for name in ("stock_gather", "gather", "auto"):
            peaks = [modes[name]["peak_bytes"], *modes[name]["train_peak_bytes"]]
            assert peaks == [model] * 3, name
        assert modes["auto"]["auto_gather"] is True  # tiny model, plenty of free RAM

        # TRL's own no-gather mode with DeepSpeed's default ZeRO-3 settings still holds the whole model...
        assert modes["stock_nogather"]["peak_bytes"] == model
        # ...trl-ext's holds the persistent parameters plus one module at a time: less than one decoder layer.
        assert modes["stream"]["external_bytes"] == 0  # OnlineDPO makes DeepSpeed hold nothing for a whole forward
        stream = [modes["stream"]["peak_bytes"], *modes["stream"]["train_peak_bytes"]]
        assert max(stream) <= persistent + one_module < persistent + one_layer, modes["stream"]["train_peak_params"]
        assert max(stream) > persistent  # it did fetch modules

        # Budget: as many whole layers as fit (2 of 4 here), never over the budget.
        plan = modes["budget"]["plan"]
        budget = int(BUDGET_FRACTION * model)
        assert plan["budget_bytes"] == budget
        fits = [k for k in range(len(ref["layer_bytes"]) + 1) if persistent + k * one_layer + one_module <= budget]
        assert plan["gathered_layers"] == list(range(max(fits))) == [0, 1]
        budget_peaks = [modes["budget"]["peak_bytes"], *modes["budget"]["train_peak_bytes"]]
        assert max(budget_peaks) <= budget
        assert min(budget_peaks) >= persistent + plan["gathered_bytes"]  # the layers really stayed gathered
        assert max(stream) < min(budget_peaks) < model


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_grpo_and_rloo_generate_bounded_and_identical(zero3):
    for modes in zero3["ranks"]:
        for stock_name, ext_name in OTHER_TRAINERS.values():
            stock, ext = modes[stock_name], modes[ext_name]
            assert len(stock["completions"]) == 2 and len(stock["losses"]) == 2
            for key in ("completions", "losses", "greedy_tokens", "engine_step_loss"):
                assert ext[key] == stock[key], (ext_name, key)
            assert ext["generations"] == 3, ext_name
            assert ext["gc_kwargs_after_training"] == USER_GC_KWARGS, ext_name
            assert [stock["peak_bytes"], *stock["train_peak_bytes"]] == [stock["model_bytes"]] * 3
            # Persistent parameters, what DeepSpeed holds for a whole forward (lm_head.weight once TRL 1.16's GRPO
            # has used it directly), and one module at a time.
            bound = ext["persistent_bytes"] + ext["external_bytes"] + ext["max_module_bytes"]
            peaks = [ext["peak_bytes"], *ext["train_peak_bytes"]]
            assert max(peaks) <= bound < ext["model_bytes"] / 4, (ext_name, ext["train_peak_params"])


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_exception_during_generation_restores_the_model(zero3):
    for modes in zero3["ranks"]:
        for name in (*EXT_MODES, "grpo_stream", "rloo_stream"):
            got = modes[name]
            # The caller sees its own exception (not "generator didn't stop" or a cleanup error)...
            assert got["exception"] == "Injected: injected during generation", name
            # ...and hooks, coordinator limits, module modes, gradient checkpointing flags and functions,
            # generation_config, gathered parameters and module bookkeeping are exactly as before.
            assert got["state_diff"] == [], name
            assert got["state_before"]["offload_hooks"][0] > 0 and got["state_before"]["active_submodules"] == 0
            assert got["gc_kwargs_after_exception"] == USER_GC_KWARGS, name
            # The model still generates the same tokens afterwards (and trains: engine_step_loss above).
            assert got["greedy_tokens_after_exception"] == got["greedy_tokens"], name


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_gradient_checkpointing_keeps_user_kwargs(zero3):
    for modes in zero3["ranks"]:
        for name in ALL_MODES:
            assert modes[name]["gc_enabled_after_training"], name
        for name in EXT_MODES:
            assert modes[name]["gc_kwargs_after_training"] == USER_GC_KWARGS, name
        # Stock TRL re-enables checkpointing without the user's kwargs after every generation (B12).
        for name in ("stock_gather", "stock_nogather"):
            assert "preserve_rng_state" not in modes[name]["gc_kwargs_after_training"], name


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_decisions_are_logged_once(zero3):
    log = zero3["log"]
    assert log.count("generation: budget") == 2  # once per rank
    assert "keeps 2 of 4 decoder layers gathered" in log
    assert log.count('ds3_gather_for_generation="auto": the') == 2
    assert "generation will gather the whole model" in log


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_trl_no_gather_left_to_trl_is_warned_on_the_main_process(zero3):
    """`OnlineDPOConfig(ds3_gather_for_generation=False)` under ZeRO-3 without the `generation` plugin: TRL keeps the
    whole model resident (`stock_nogather` above), so trl-ext warns once, on rank 0, and names its own flag."""
    assert [modes["advice"]["enabled"] for modes in zero3["ranks"]] == [[], []]
    warning = (
        "[trl_ext.build|WARNING] trl-ext: OnlineDPOConfig(ds3_gather_for_generation=False) is left to TRL, "
        "whose ZeRO-3 generation keeps the whole model resident with DeepSpeed's default settings; set trl-ext's "
        '`ds3_gather_for_generation=False` (or "auto") for generation within a bounded budget.'
    )
    assert zero3["log"].count(warning) == 1  # main process only; not for the modes where the plugin is enabled
    assert zero3["log"].count("is left to TRL, whose ZeRO-3 generation") == 1


# ---------------------------------------------------------------------------------------------------------------
# single process: no ZeRO-3 (pass-through), configuration, context-manager contract
# ---------------------------------------------------------------------------------------------------------------


def _gc_funcs(model):
    return [vars(m).get("_gradient_checkpointing_func") for m in model.modules()]


@pytest.mark.slow  # a few seconds: kept out of the fast loop's 90 s
def test_without_zero3_passes_through_and_keeps_user_kwargs(online_dpo_args, tokenizer):
    stock = helpers.gc_online_trainer(online_dpo_args, tokenizer)
    stock.train()
    stock_losses = [h["loss"] for h in stock.state.log_history if "loss" in h]
    stock_kwargs = next(f for f in _gc_funcs(stock.model) if f is not None).keywords
    assert "preserve_rng_state" not in stock_kwargs  # B12: TRL dropped the user's kwargs

    with trl_ext.install(ds3_gather_for_generation=False):
        trainer = helpers.gc_online_trainer(online_dpo_args, tokenizer)
        trainer.train()
        state = trainer._trl_ext.state["generation"]
    assert state.generations == 2 and "no-zero3" in state.logged  # used, and said why it only passes through
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == stock_losses
    funcs = [f for f in _gc_funcs(trainer.model) if f is not None]
    assert funcs and all(f.keywords == USER_GC_KWARGS for f in funcs)


class Injected(RuntimeError):
    pass


def test_exception_without_zero3_restores_everything(online_dpo_args, tokenizer):
    from trl.experimental.online_dpo import online_dpo_trainer as odt

    with trl_ext.install(ds3_gather_for_generation="auto"):
        trainer = helpers.gc_online_trainer(online_dpo_args, tokenizer, max_steps=1)
        trainer.train()
        model = trainer.model
        model.train()
        modes = [m.training for m in model.modules()]
        funcs = _gc_funcs(model)
        flags = [vars(m).get("gradient_checkpointing") for m in model.modules()]
        config, config_json = model.generation_config, model.generation_config.to_json_string()
        # The trainer module's `unwrap_model_for_generation` is the plugin's while this trainer runs (as in train()).
        with trainer._trl_ext.running(), pytest.raises(Injected, match="boom"):
            with odt.unwrap_model_for_generation(
                model, trainer.accelerator, generation_kwargs=trainer.generation_kwargs
            ) as unwrapped:
                assert not unwrapped.is_activation_checkpointing  # off for generation
                unwrapped.eval()
                unwrapped.generation_config.cache_implementation = "static"  # as OnlineDPO does inside
                raise Injected("boom")
        assert [m.training for m in model.modules()] == modes
        assert _gc_funcs(model) == funcs  # the very same functions, so the user's kwargs
        assert [vars(m).get("gradient_checkpointing") for m in model.modules()] == flags
        assert model.generation_config is config and config.to_json_string() == config_json


def test_context_yields_exactly_once_on_every_path(online_dpo_args, tokenizer):
    """Regression for TRL #2639 ("generator didn't stop"): a second yield would surface as a RuntimeError here."""
    from trl_ext.plugins.generation import GenerationContext, GenerationState

    with trl_ext.install(ds3_gather_for_generation=True):
        trainer = helpers.gc_online_trainer(online_dpo_args, tokenizer, max_steps=1)
    state = GenerationState(True, {})
    for _ in range(2):  # normal exit, twice (fresh context each time)
        ctx = GenerationContext(state, trainer.model, trainer.accelerator, None)
        with ctx as model:
            assert model is trainer.model
        assert ctx.__exit__(None, None, None) is False  # a second exit does nothing
    ctx = GenerationContext(state, trainer.model, trainer.accelerator, None)
    with pytest.raises(Injected):
        with ctx:
            raise Injected("original")
    ctx = GenerationContext(state, trainer.model, trainer.accelerator, None)
    with ctx, pytest.raises(RuntimeError, match="entered twice"):
        ctx.__enter__()
    assert state.generations == 4


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (dict(ds3_gather_for_generation=False, plugins={"generation": {"budgt": "1GB"}}), "Unknown option"),
        (dict(ds3_gather_for_generation=False, plugins={"generation": {"budget": "8 furlongs"}}), "must be a size"),
        (
            dict(ds3_gather_for_generation=False, plugins={"generation": {"budget": 1.5}}),
            r"must be a size .* or a fraction",
        ),
        (dict(ds3_gather_for_generation=False, plugins={"generation": {"budget": -3}}), "must be a size"),
        (dict(ds3_gather_for_generation=False, plugins={"generation": {"budget": True}}), "must be a size"),
        (dict(ds3_gather_for_generation=True, plugins={"generation": {"budget": "8GB"}}), "gathers the whole model"),
        (dict(ds3_gather_for_generation=False, plugins={"generation": {"auto_margin": 0.1}}), "only applies"),
        (dict(ds3_gather_for_generation="auto", plugins={"generation": {"auto_margin": -1}}), "must be a number >= 0"),
        (dict(plugins={"generation": {"budget": "8GB"}}), "is not set"),
    ],
)
def test_bad_configuration_is_refused(flags, match):
    with pytest.raises(UsageError, match=match):
        trl_ext.install(**flags)


def test_budget_parsing():
    from trl_ext.spec import Size, parse_size

    # The plugin's `budget` option uses trl-ext's one size grammar (tests/test_config.py covers every plugin).
    assert parse_size("8GB") == Size("bytes", 8e9)
    assert parse_size("8 GiB") == Size("bytes", 8 * 2**30)
    assert parse_size("512MiB") == Size("bytes", 512 * 2**20)
    assert parse_size(1 << 20) == Size("bytes", float(1 << 20))
    assert parse_size("1000") == Size("bytes", 1000.0)
    assert parse_size(0.5) == Size("fraction", 0.5)
    assert parse_size("0.25") == Size("fraction", 0.25)  # from YAML / environment
    assert parse_size("25%") == Size("fraction", 0.25)


def test_budget_plan_on_a_plain_model():
    from trl_ext.plugins.generation import BudgetPlan, decoder_layers, param_bytes
    from trl_ext.testing import make_model

    model = make_model(num_layers=4)
    layers = decoder_layers(model)
    assert layers == list(model.model.layers)
    layer = sum(param_bytes(p) for p in layers[0].parameters())
    largest = max(sum(param_bytes(p) for p in m.parameters(recurse=False)) for m in model.modules())
    plan = BudgetPlan(model, ("bytes", 3 * layer + largest))
    assert plan.gathered_layers == [0, 1, 2] and plan.gathered_bytes == 3 * layer
    assert BudgetPlan(model, ("fraction", 1.0)).gathered_layers == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="below the"):
        BudgetPlan(model, ("bytes", largest - 1))


def test_auto_decides_once_from_free_memory(monkeypatch):
    import types

    import torch

    from trl_ext.plugins import generation
    from trl_ext.testing import make_model

    model = make_model(num_layers=4)
    model_bytes = sum(generation.param_bytes(p) for p in model.parameters())
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    free = {"bytes": int(model_bytes * 1.3)}
    # `GenerationContext` looks the function up in its own module (trl_ext/plugins/generation/context.py).
    monkeypatch.setattr(generation.context, "free_memory_bytes", lambda device: free["bytes"])

    def decide(options):
        state = generation.GenerationState("auto", options)
        return state, generation.GenerationContext(state, model, accelerator, None)._choose_mode(model)

    state, mode = decide({})  # 1.3x free, 25% margin: gather
    assert (mode, state.auto_gather, state.logged) == ("gather", True, {"auto"})
    state, mode = decide({"auto_margin": 0.5})  # 1.3x free, 50% margin: stream
    assert (mode, state.auto_gather) == ("stream", False)
    free["bytes"] = 0  # a decision is made once per trainer: later calls do not look at memory again
    assert generation.GenerationContext(state, model, accelerator, None)._choose_mode(model) == "stream"
    state, mode = decide({"budget": 0.6})  # does not fit, with a budget: keep what fits gathered
    assert mode == "budget" and state.plan.gathered_layers == [0, 1] and state.plan.budget_bytes <= 0.6 * model_bytes
