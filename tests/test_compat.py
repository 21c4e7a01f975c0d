"""Every TRL / transformers / DeepSpeed fact in `trl_ext._compat`, checked against the installed versions.

A new release that changes one of them fails here first, with the fact's name and what to re-check, before any plugin
test (where the same change would show up as a wrong metric inside a 2-process run). Each test reads the installed
source (`inspect`), checks that attributes exist and that signatures and return layouts match.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from trl_ext import _compat

TRL = _compat.installed_version("trl")


def _fail(fact: str, detail: str) -> str:
    versions = ", ".join(f"{d}=={_compat.installed_version(d)}" for d in ("trl", "transformers", "deepspeed"))
    return (
        f"trl_ext._compat.{fact} no longer holds on {versions}: {detail}. Re-check its consumers (see its comment) "
        "before raising the supported range."
    )


def _dpo():
    from trl.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer


def _online():
    from trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer

    return OnlineDPOTrainer


def _source(obj) -> str:
    return inspect.getsource(obj)


def _params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


# -------------------------------------------------------------------------------------------------------------------
# Range and trainers
# -------------------------------------------------------------------------------------------------------------------


def test_installed_trl_is_in_the_supported_range():
    assert _compat.is_supported_trl(TRL), _fail("TRL_MIN/TRL_MAX_EXCLUSIVE", f"trl {TRL} is outside the range")
    low, high = ".".join(map(str, _compat.TRL_MIN)), ".".join(map(str, _compat.TRL_MAX_EXCLUSIVE))
    assert _compat.SUPPORTED_TRL_SPEC == f">={low},<{high}"


@pytest.mark.parametrize("name", sorted(_compat.TRAINERS))
def test_trainer_locations(name):
    module, cls = _compat.TRAINERS[name]
    assert hasattr(importlib.import_module(module), cls), _fail("TRAINERS", f"{module}.{cls} is gone")


@pytest.mark.parametrize("name", sorted(_compat.GENERATION_HELPER_MODULES))
def test_generation_helper_imported_by_name(name):
    module = importlib.import_module(_compat.GENERATION_HELPER_MODULES[name])
    assert hasattr(module, "unwrap_model_for_generation"), _fail(
        "GENERATION_HELPER_MODULES", f"{module.__name__} no longer imports `unwrap_model_for_generation` by name"
    )


def test_trl_ignored_flags():
    from trl import DPOConfig

    source = _source(_dpo().__init__)
    for flag in _compat.TRL_IGNORED_FLAGS["DPOTrainer"]:
        assert flag in {f.name for f in dataclasses.fields(DPOConfig)}, _fail("TRL_IGNORED_FLAGS", f"no {flag}")
        assert f"args.{flag}" in source, _fail("TRL_IGNORED_FLAGS", f"DPOTrainer.__init__ no longer reads {flag}")
    assert _compat.dpo_honours_padding_free() is False, _fail(
        "TRL_IGNORED_FLAGS", "DataCollatorForPreference has a padding_free field: TRL honours the flag again"
    )


def test_fused_lm_head_since():
    dpo_source = inspect.getsource(importlib.import_module("trl.trainer.dpo_trainer"))
    uses_fused = _compat.FUSED_LM_HEAD_KWARG in dpo_source
    assert uses_fused == _compat.dpo_uses_fused_lm_head(TRL), _fail(
        "DPO_FUSED_LM_HEAD_SINCE", f"`{_compat.FUSED_LM_HEAD_KWARG}` in dpo_trainer.py: {uses_fused}"
    )


# -------------------------------------------------------------------------------------------------------------------
# precompute_ref_batch_size
# -------------------------------------------------------------------------------------------------------------------


def test_precompute_method_signature():
    method = getattr(_dpo(), _compat.DPO_PRECOMPUTE_METHOD, None)
    assert method is not None, _fail("DPO_PRECOMPUTE_METHOD", "DPOTrainer has no such method")
    assert _params(method) == ["self", "dataset", "name", "batch_size"], _fail(
        "DPO_PRECOMPUTE_METHOD", f"signature is {inspect.signature(method)}"
    )


def test_precompute_iterable_message_is_trls_first_check():
    source = _source(getattr(_dpo(), _compat.DPO_PRECOMPUTE_METHOD))
    body = source.split(":", 1)[1]
    # The adjacent string literals of the `raise ValueError(...)`, joined as Python joins them.
    match = re.search(r"isinstance\(dataset, IterableDataset\):\s*raise ValueError\(((?:\s*\"[^\"]*\")+)\s*\)", body)
    assert match, _fail("DPO_PRECOMPUTE_ITERABLE_MESSAGE", "no `raise ValueError` for an IterableDataset")
    message = "".join(re.findall(r"\"([^\"]*)\"", match.group(1)))
    assert message == _compat.DPO_PRECOMPUTE_ITERABLE_MESSAGE, _fail("DPO_PRECOMPUTE_ITERABLE_MESSAGE", message)
    first = next(line.strip() for line in body.splitlines()[1:] if line.strip() and not line.strip().startswith("#"))
    assert first.startswith("if isinstance(dataset, IterableDataset)"), _fail(
        "DPO_PRECOMPUTE_ITERABLE_MESSAGE", f"it is no longer the first check (first statement: {first})"
    )


def test_compute_ref_log_probs():
    method = getattr(_dpo(), _compat.DPO_COMPUTE_REF_METHOD, None)
    assert method is not None and _params(method) == ["self", "model", "inputs"], _fail(
        "DPO_COMPUTE_REF_METHOD", "missing or new signature"
    )
    # `(chosen, rejected)`: a pair of names, or the chosen/rejected halves of one tensor (`.chunk(2, dim=0)`); 1.14
    # moved the body to `_compute_ref_log_probs(model, inputs)`, which it returns.
    returned = re.findall(r"return (.+)", _source(method))[-1]
    if returned.strip() == "self._compute_ref_log_probs(model, inputs)":
        returned = re.findall(r"return (.+)", _source(_dpo()._compute_ref_log_probs))[-1]
    assert re.fullmatch(r"\w+, \w+|\w+\.chunk\(2, dim=0\)", returned.strip()), _fail(
        "DPO_COMPUTE_REF_METHOD", f"no longer returns a (chosen, rejected) pair: `return {returned}`"
    )


def test_precompute_engine_and_hash():
    source = _source(getattr(_dpo(), _compat.DPO_PRECOMPUTE_METHOD))
    engine = _compat.DPO_PRECOMPUTE_ENGINE_ATTR
    assert f"self.{engine} = prepare_deepspeed(self.model, self.accelerator)" in source, _fail(
        "DPO_PRECOMPUTE_ENGINE_ATTR", "TRL builds its precompute engine differently"
    )
    prepare = _compat.import_object(*_compat.DPO_PREPARE_DEEPSPEED)
    assert _params(prepare)[:2] == ["model", "accelerator"], _fail("DPO_PREPARE_DEEPSPEED", "new signature")
    hash_module = _compat.import_object(*_compat.DPO_HASH_MODULE)
    assert _params(hash_module) == ["module"], _fail("DPO_HASH_MODULE", "new signature")
    # Either `__init__` stores `hash_module(...)` in the attribute, or the precompute calls `hash_module` itself.
    init = _source(_dpo().__init__)
    stored = re.search(rf"self\.{_compat.DPO_PRECOMPUTE_HASH_ATTR} = \(?\s*hash_module\(", init)
    assert stored or "hash_module(self.ref_model or self.model)" in source, _fail(
        "DPO_PRECOMPUTE_HASH_ATTR", "TRL hashes the reference weights another way"
    )


# -------------------------------------------------------------------------------------------------------------------
# sync_metrics: DPO
# -------------------------------------------------------------------------------------------------------------------


def _dpo_gather_sequence() -> list[tuple[str, int]]:
    """`(metric, gathers since the previous metric write)` in the order `_compute_loss` writes its metrics."""
    source = _source(getattr(_dpo(), _compat.DPO_COMPUTE_LOSS))
    buffer = re.escape(_compat.DPO_METRICS_BUFFER)
    sequence, pending = [], 0
    for line in source.splitlines():
        # On one line, the gather is evaluated before the append it feeds (`_metrics[mode]["x"].append(gather(...))`).
        pending += len(re.findall(r"accelerator\.gather(?:_for_metrics)?\(", line))
        for name in re.findall(rf"self\.{buffer}\[mode\]\[\"([^\"]+)\"\]", line):
            sequence.append((name, pending))
            pending = 0
    return sequence


def test_dpo_gather_order_and_metric_names():
    got = _dpo_gather_sequence()
    assert tuple(got) == _compat.DPO_METRIC_GATHERS, _fail("DPO_METRIC_GATHERS", f"_compute_loss now does {got}")
    names = [name for name, _ in got]
    token = [n for n in names if n in _compat.DPO_TOKEN_METRICS]
    pair = [n for n in names if n in _compat.DPO_PAIR_METRICS]
    assert tuple(token) == _compat.DPO_TOKEN_METRICS, _fail("DPO_TOKEN_METRICS", f"order {token}")
    assert tuple(pair) == _compat.DPO_PAIR_METRICS and names[-len(pair) :] == pair, _fail(
        "DPO_PAIR_METRICS", f"order {pair}, not last"
    )
    optional = dict(got)["aux_loss"] + dict(got)["num_tokens"]
    assert sum(n for _, n in got) - optional == _compat.DPO_GATHERS_PER_CALL, _fail("DPO_GATHERS_PER_CALL", str(got))


def test_dpo_pair_metrics_gather_one_vector_each():
    source = _source(getattr(_dpo(), _compat.DPO_COMPUTE_LOSS))
    # The per-pair values go through `accelerator.gather` (vectors); the token metrics through `gather_for_metrics`.
    assert len(re.findall(r"accelerator\.gather\(", source)) == len(_compat.DPO_PAIR_METRICS), _fail(
        "DPO_PAIR_METRICS", "the number of `accelerator.gather(` calls changed"
    )


def test_dpo_private_attributes():
    init = _source(_dpo().__init__)
    attrs = (_compat.DPO_AUX_LOSS_FLAG, _compat.DPO_TOTAL_TRAIN_TOKENS, _compat.DPO_METRICS_BUFFER)
    for attr in (*attrs, _compat.DPO_USE_WEIGHTING_ATTR):
        assert f"self.{attr} =" in init, _fail(attr, f"DPOTrainer.__init__ no longer sets self.{attr}")
    loss = getattr(_dpo(), _compat.DPO_COMPUTE_LOSS)
    assert _params(loss) == ["self", "model", "inputs", "return_outputs"], _fail("DPO_COMPUTE_LOSS", "new signature")
    assert f"self.{_compat.DPO_TOTAL_TRAIN_TOKENS} +=" in _source(loss), _fail(
        "DPO_TOTAL_TRAIN_TOKENS", "_compute_loss no longer counts the training tokens"
    )
    assert f"{_compat.DPO_METRICS_BUFFER}[mode].clear()" in _source(_dpo().log), _fail(
        "DPO_METRICS_BUFFER", "DPOTrainer.log no longer clears the buffer"
    )


# -------------------------------------------------------------------------------------------------------------------
# sync_metrics: OnlineDPO
# -------------------------------------------------------------------------------------------------------------------


def test_online_dpo_metric_names():
    init = _source(_online().__init__)
    stats = re.search(rf"self\.{_compat.ONLINE_DPO_STATS} = \{{(.*?)\}}", init, re.S)
    assert stats, _fail("ONLINE_DPO_STATS", "OnlineDPOTrainer.__init__ no longer builds `self.stats`")
    names = set(re.findall(r"\"([^\"]+)\":", stats.group(1)))
    names |= set(re.findall(rf"self\.{_compat.ONLINE_DPO_STATS}\[\"([^\"]+)\"\] = \[\]", init))
    known = set(_compat.ONLINE_DPO_PAIR_METRICS + _compat.ONLINE_DPO_COMPLETION_METRICS)
    assert names == known, _fail("ONLINE_DPO_*_METRICS", f"new {sorted(names - known)}, gone {sorted(known - names)}")
    step = _source(_online().training_step)
    for name in names:
        assert f'"{name}"' in step, _fail("ONLINE_DPO_*_METRICS", f"training_step no longer logs {name}")


def test_online_dpo_step_methods_and_generate_layout():
    for name in _compat.ONLINE_DPO_STEP_METHODS:
        assert callable(getattr(_online(), name, None)), _fail("ONLINE_DPO_STEP_METHODS", f"no {name}")
    generate = _source(_online()._generate)
    returned = re.findall(r"return (.+)", generate)[-1]
    fields = [f.strip() for f in returned.split(",")]
    assert tuple(fields[:4]) == _compat.ONLINE_DPO_GENERATE_RETURN, _fail("ONLINE_DPO_GENERATE_RETURN", returned)
    assert fields[_compat.ONLINE_DPO_COMPLETION_IDS] == "completion_ids"
    assert fields[_compat.ONLINE_DPO_COMPLETION_MASK] == "completion_mask"
    step = _source(_online().training_step)
    assert re.search(r"prompt_ids, prompt_mask, completion_ids, completion_mask.* = self\._generate\(", step), _fail(
        "ONLINE_DPO_GENERATE_RETURN", "training_step unpacks `_generate` differently"
    )


def test_online_dpo_eos_ids():
    init, step = _source(_online().__init__), _source(_online().training_step)
    assert f"self.{_compat.ONLINE_DPO_TOKENIZER_ATTR}" in init, _fail("ONLINE_DPO_TOKENIZER_ATTR", "gone")
    # With the attribute, `val/contain_eos_token` checks every id in it; without, the tokenizer's EOS id only.
    if f"self.{_compat.ONLINE_DPO_EOS_IDS_ATTR} =" in init:
        expected = f"self.{_compat.ONLINE_DPO_EOS_IDS_ATTR}"
    else:
        expected = f"self.{_compat.ONLINE_DPO_TOKENIZER_ATTR}.eos_token_id"
    assert expected in step, _fail("ONLINE_DPO_EOS_IDS_ATTR", f"training_step does not check `{expected}`")


def test_online_dpo_loss_rounding():
    source = _source(_online()._maybe_log_save_evaluate)
    assert re.search(rf"logs\[\"loss\"\] = round\(.*, {_compat.ONLINE_DPO_LOSS_DECIMALS}\)", source), _fail(
        "ONLINE_DPO_LOSS_DECIMALS", "OnlineDPO no longer rounds its logged loss this way"
    )


# -------------------------------------------------------------------------------------------------------------------
# sync_metrics: transformers Trainer
# -------------------------------------------------------------------------------------------------------------------


def test_loss_gather_modules():
    from transformers import Trainer

    for module_name in _compat.LOSS_GATHER_MODULES:
        module = importlib.import_module(module_name)
        assert callable(getattr(module, "nested_gather", None)), _fail(
            "LOSS_GATHER_MODULES", f"{module_name} has no module-level `nested_gather`"
        )
    assert "nested_gather(tr_loss" in _source(Trainer._maybe_log_save_evaluate), _fail(
        "LOSS_GATHER_MODULES", "Trainer._maybe_log_save_evaluate no longer gathers the loss with `nested_gather`"
    )


def test_trainer_members():
    from transformers import Trainer

    for name in _compat.TRAINER_METHODS:
        assert callable(getattr(Trainer, name, None)), _fail("TRAINER_METHODS", f"Trainer.{name} is gone")
    source = inspect.getsource(importlib.import_module("transformers.trainer"))
    for attr in _compat.TRAINER_STATE_ATTRS:
        assert f"self.{attr} =" in source, _fail("TRAINER_STATE_ATTRS", f"Trainer no longer sets self.{attr}")


# -------------------------------------------------------------------------------------------------------------------
# generation: DeepSpeed ZeRO-3
# -------------------------------------------------------------------------------------------------------------------


def test_deepspeed_coordinator():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    init = _source(PartitionedParameterCoordinator.__init__)
    for attr in _compat.DS_COORDINATOR_LIMITS:
        short = attr.replace("_PartitionedParameterCoordinator", "")
        assert re.search(rf"self\.{re.escape(short)}\b(: [\w\[\], ]+)? =", init), _fail(
            "DS_COORDINATOR_LIMITS", f"the coordinator no longer sets {short}"
        )
    fn = PartitionedParameterCoordinator.__dict__.get(_compat.DS_RELEASE_CACHE)
    cells = getattr(fn, "__closure__", None) or ()
    candidates = (fn, getattr(fn, "__wrapped__", None), *(c.cell_contents for c in cells))
    assert any(hasattr(c, "cache_clear") for c in candidates), _fail("DS_RELEASE_CACHE", "no lru_cache to clear")
    for name in _compat.DS_COORDINATOR_METHODS:
        assert callable(getattr(PartitionedParameterCoordinator, name, None)), _fail("DS_COORDINATOR_METHODS", name)


def test_deepspeed_offload_and_params():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    init = _source(DeepSpeedZeRoOffload.__init__)
    for attr in _compat.DS_OFFLOAD_ATTRS:
        assert f"self.{attr} =" in init, _fail("DS_OFFLOAD_ATTRS", f"DeepSpeedZeRoOffload no longer sets {attr}")
    for name in _compat.DS_OFFLOAD_METHODS:
        assert callable(getattr(DeepSpeedZeRoOffload, name, None)), _fail("DS_OFFLOAD_METHODS", name)
    assert f"self.{_compat.DS_OPTIMIZER_OFFLOAD_ATTR} =" in _source(DeepSpeedZeroOptimizer_Stage3.__init__), _fail(
        "DS_OPTIMIZER_OFFLOAD_ATTR", "the ZeRO-3 optimizer no longer holds the offload there"
    )
    assert isinstance(_compat.import_object(*_compat.DS_FWD_MODULE_STACK), list), _fail("DS_FWD_MODULE_STACK", "")
    offload_source = inspect.getsource(importlib.import_module("deepspeed.runtime.zero.parameter_offload"))
    assert f".{_compat.DS_EXTERNAL_PARAMS_ATTR}" in offload_source, _fail("DS_EXTERNAL_PARAMS_ATTR", "gone")
    partition = inspect.getsource(importlib.import_module("deepspeed.runtime.zero.partition_parameters"))
    for attr in _compat.DS_PARAM_ATTRS:
        assert f"param.{attr} =" in partition or f".{attr} = " in partition, _fail("DS_PARAM_ATTRS", attr)


# -------------------------------------------------------------------------------------------------------------------
# generation: TRL's generation context, transformers' gradient checkpointing
# -------------------------------------------------------------------------------------------------------------------


def test_generation_helper_params():
    from trl.models.utils import unwrap_model_for_generation

    params = _params(unwrap_model_for_generation)
    for name in (*_compat.GENERATION_HELPER_PARAMS, _compat.GENERATION_HELPER_KWARGS_PARAM):
        assert name in params, _fail("GENERATION_HELPER_PARAMS", f"unwrap_model_for_generation has no `{name}`")
    override = _compat.import_object(*_compat.TRL_GENERATION_CONFIG_OVERRIDE)
    assert _compat.GENERATION_HELPER_KWARGS_PARAM in _params(override), _fail(
        "TRL_GENERATION_CONFIG_OVERRIDE", "it no longer takes the generation kwargs"
    )


def test_trl_applies_generation_kwargs_where_stated():
    """TRL's override, run on a model with a generation config: it applies the kwargs (to a copy, put back after)
    exactly where `trl_applies_generation_kwargs()` says, with the installed transformers."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    override = _compat.import_object(*_compat.TRL_GENERATION_CONFIG_OVERRIDE)
    model = SimpleNamespace(generation_config=GenerationConfig(max_new_tokens=3))
    with override(model, generation_kwargs={"max_new_tokens": 7}):
        inside = model.generation_config.max_new_tokens
    assert model.generation_config.max_new_tokens == 3
    applies = _compat.trl_applies_generation_kwargs()
    assert (inside == 7) == applies, _fail(
        "TRL_GENERATION_KWARGS_BELOW_TRANSFORMERS", f"TRL {'did not apply' if applies else 'applied'} the kwargs"
    )
    below = ".".join(map(str, _compat.TRL_GENERATION_KWARGS_BELOW_TRANSFORMERS))
    assert _compat.trl_applies_generation_kwargs("4.57.1") and not _compat.trl_applies_generation_kwargs(below)


def test_gradient_checkpointing_attrs():
    from trl_ext.testing import make_model

    flag, func = _compat.GRADIENT_CHECKPOINTING_ATTRS
    model = make_model(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    model.gradient_checkpointing_enable()
    enabled = [m for m in model.modules() if getattr(m, flag, False)]
    assert enabled, _fail("GRADIENT_CHECKPOINTING_ATTRS", f"no module has `{flag}` set")
    assert all(callable(vars(m).get(func)) for m in enabled), _fail(
        "GRADIENT_CHECKPOINTING_ATTRS", f"an enabled module has no `{func}` of its own"
    )


# -------------------------------------------------------------------------------------------------------------------
# precompute_ref_batch_size: what determines the reference log-probs
# -------------------------------------------------------------------------------------------------------------------


def test_dpo_truncation_fields_and_ld_alpha():
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    for cls in (DPOConfig, DataCollatorForPreference):
        names = {f.name for f in dataclasses.fields(cls)}
        for name in _compat.DPO_TRUNCATION_FIELDS:
            assert name in names, _fail("DPO_TRUNCATION_FIELDS", f"{cls.__name__} has no `{name}`")
    attr = _compat.DPO_LD_ALPHA_ATTR
    assert f"self.{attr} = args.{attr}" in _source(_dpo().__init__), _fail("DPO_LD_ALPHA_ATTR", "not set in __init__")


def test_attention_implementation_sharding_flags_and_dataset_fingerprint():
    from datasets import Dataset
    from transformers import LlamaConfig, Trainer

    config = LlamaConfig(attn_implementation="eager")
    assert getattr(config, _compat.ATTN_IMPLEMENTATION_ATTR, None) == "eager", _fail("ATTN_IMPLEMENTATION_ATTR", "")
    source = _source(Trainer.create_accelerator_and_postprocess)
    for flag in _compat.TRAINER_SHARDING_FLAGS:
        assert f"self.{flag} =" in source, _fail("TRAINER_SHARDING_FLAGS", f"Trainer no longer sets `{flag}` there")
    rows = Dataset.from_dict({"x": [1, 2]})
    fingerprint = getattr(rows, _compat.DATASET_FINGERPRINT_ATTR, None)
    assert isinstance(fingerprint, str) and fingerprint != getattr(
        rows.add_column("y", [3, 4]), _compat.DATASET_FINGERPRINT_ATTR
    ), _fail("DATASET_FINGERPRINT_ATTR", "not the dataset's content hash")


# -------------------------------------------------------------------------------------------------------------------
# padding_free: TRL's fused LM head
# -------------------------------------------------------------------------------------------------------------------


def test_fused_lm_head_fields():
    utils = importlib.import_module(_compat.FUSED_LM_HEAD_OUTPUT[0])
    output = getattr(utils, _compat.FUSED_LM_HEAD_OUTPUT[1], None)
    if not _compat.dpo_uses_fused_lm_head(TRL):
        assert output is None, _fail("DPO_FUSED_LM_HEAD_SINCE", f"trl {TRL} already has the fused output")
        return
    fields = {f.name for f in dataclasses.fields(output)}
    missing = set(_compat.FUSED_LM_HEAD_FIELDS) - fields
    assert not missing, _fail("FUSED_LM_HEAD_FIELDS", f"FusedCausalLMOutput lost {sorted(missing)}")
    # Both packing plugins re-pad every per-token field TRL returns (`toolkit.packing.glue.repad_outputs` reads this
    # list; one left packed would reach TRL in the wrong shape); the others are scalars (`loss`, `aux_loss`).
    assert set(_compat.FUSED_LM_HEAD_FIELDS) == fields - {"loss", "aux_loss"}


def test_moe_aux_loss():
    """The load-balancing loss prompt_sharing recomputes: signature, and a mask-weighted mean over token rows (a padded
    row with a zero mask changes nothing; a real row counted twice changes the value)."""
    import torch

    module, name = _compat.MOE_AUX_LOSS
    balance = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(balance).parameters)
    assert params[:4] == ["gate_logits", "num_experts", "top_k", "attention_mask"], _fail("MOE_AUX_LOSS", str(params))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.long)
    value = balance((logits,), 4, 2, mask)
    padded = torch.cat([logits.view(2, 3, 4), torch.randn(2, 1, 4, generator=g, dtype=torch.float64)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 1, dtype=torch.long)], 1)
    assert torch.allclose(balance((padded.reshape(8, 4),), 4, 2, padded_mask), value), _fail("MOE_AUX_LOSS", "mask")
    doubled = torch.cat([logits, logits[:1]])
    assert not torch.allclose(balance((doubled,), 4, 2, None), value), _fail("MOE_AUX_LOSS", "not a token mean")
    source = inspect.getsource(importlib.import_module("transformers.models.mixtral.modeling_mixtral"))
    call = "load_balancing_loss_func(\n                outputs.router_logits,\n                self.num_experts,"
    assert call in source, _fail("MOE_AUX_LOSS", "MixtralForCausalLM.forward no longer calls it as documented")


def test_dpo_tokenized_columns(tokenizer, dpo_args):
    """The packing self-checks size their probe from these columns of the dataset `DPOTrainer` tokenized."""
    from trl import DPOTrainer

    from trl_ext.testing import make_model, make_preference_dataset
    from trl_ext.toolkit.probe import dataset_longest_pair, training_max_length

    trainer = DPOTrainer(
        make_model(),
        ref_model=make_model(seed=1),
        args=dpo_args(max_length=1000, bf16=False),
        train_dataset=make_preference_dataset(4),
        processing_class=tokenizer,
    )
    assert set(_compat.DPO_TOKENIZED_COLUMNS) <= set(trainer.train_dataset.column_names)
    rows = trainer.train_dataset
    longest = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows)
    assert dataset_longest_pair(rows) == longest == training_max_length(trainer) < 1000


# -------------------------------------------------------------------------------------------------------------------
# Attention registries, vision flags, Online DPO's truncation, Trainer state, model facts
# -------------------------------------------------------------------------------------------------------------------


def test_attention_registries_and_config_field():
    from transformers import AttentionInterface, PretrainedConfig
    from transformers.masking_utils import AttentionMaskInterface

    for interface in (AttentionInterface, AttentionMaskInterface):
        registry = _compat.attention_registry(interface)
        assert isinstance(registry, dict) and "sdpa" in registry, _fail(
            "ATTENTION_REGISTRY_FIELD", f"{interface.__name__}.{_compat.ATTENTION_REGISTRY_FIELD} is not the registry"
        )
    interface = AttentionInterface()
    name = "trl_ext_compat_probe"
    AttentionInterface.register(name, lambda *a, **k: None)
    try:
        assert name in _compat.attention_registry(AttentionInterface) and name in interface
    finally:
        _compat.attention_registry(AttentionInterface).pop(name, None)
    assert name not in AttentionInterface(), _fail("ATTENTION_REGISTRY_FIELD", "popping no longer unregisters")
    config = PretrainedConfig()
    config._attn_implementation = "eager"
    assert config.__dict__.get(_compat.ATTN_IMPLEMENTATION_FIELD) == "eager", _fail(
        "ATTN_IMPLEMENTATION_FIELD", "the `_attn_implementation` property no longer stores into it"
    )


def test_dpo_vision_attributes():
    source = _source(_dpo().__init__)
    for attr in _compat.TRL_VISION_ATTRS:
        assert f"self.{attr} =" in source, _fail("TRL_VISION_ATTRS", f"DPOTrainer.__init__ no longer sets self.{attr}")


def test_dpo_logits_helpers_scoring_methods_and_trainer_step_hooks():
    module = importlib.import_module(_compat.DPO_LOGITS_MODULE)
    for name in _compat.DPO_SCORING_METHODS:
        assert callable(getattr(_dpo(), name, None)), _fail("DPO_SCORING_METHODS", f"DPOTrainer has no `{name}`")
    if not _compat.dpo_uses_fused_lm_head():  # TRL < 1.15 reads the logits through the helpers a probe finds
        source = _source(_dpo()._compute_loss)
        helpers = _compat.dpo_logits_helpers()
        assert helpers[:1] == (_compat.DPO_LOGPROBS_HELPER,) and set(helpers[1:]) <= set(_compat.DPO_ENTROPY_HELPERS)
        assert set(_compat.DPO_LOGITS_HELPERS) <= set(helpers) or _compat.DPO_LOGITS_HELPERS[1] not in source
        for name in helpers:
            assert callable(getattr(module, name, None)) and f"{name}(" in source, _fail(
                "DPO_LOGITS_HELPERS", f"`{_compat.DPO_LOGITS_MODULE}.{name}` is gone or not called by _compute_loss"
            )


def test_dpo_layout_probes_and_refusal_facts():
    """The probed DPO layout is one trl-ext knows (the fused head, or the logits helpers), and a refusal fact holds
    exactly where its probe says: 1.15 without Triton has no chunked log-prob function for its fused head."""
    utils = importlib.import_module("trl.trainer.utils")
    fused = _compat.dpo_has_fused_head()
    assert fused == (_compat.FUSED_LM_HEAD_KWARG in _source(_dpo()._compute_loss))
    assert fused == (_compat.dpo_logits_helpers() == ()), _fail(
        "DPO_UNKNOWN_LOGITS_HELPERS", "this TRL's DPOTrainer reads its logits through helpers trl-ext does not know"
    )
    fact = _compat.dpo_training_refusal()
    assert fact in (None, _compat.DPO_FUSED_HEAD_WITHOUT_KERNEL)
    assert (fact is not None) == (fused and getattr(utils, "_ChunkedLogProbFunction", object()) is None)
    assert set(_compat.TRL_FACTS) == {
        _compat.DPO_FUSED_HEAD_WITHOUT_KERNEL.name,
        _compat.DPO_UNKNOWN_LOGITS_HELPERS.name,
    }
    assert all(name in fact.refusal("x") for name, fact in _compat.TRL_FACTS.items())
    import transformers

    trainer = transformers.Trainer
    assert callable(getattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD, None)), _fail(
        "TRAINER_BATCH_SAMPLES_METHOD", "transformers.Trainer has no such method"
    )
    assert _params(getattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD))[1:3] == ["epoch_iterator", "num_batches"]
    assert getattr(trainer, _compat.TRAINER_LOSS_SCALED_ATTR, "missing") is None, _fail(
        "TRAINER_LOSS_SCALED_ATTR", "transformers.Trainer no longer declares it (default None)"
    )
    assert f"self.{_compat.TRAINER_LOSS_SCALED_ATTR}" in _source(trainer.training_step), _fail(
        "TRAINER_LOSS_SCALED_ATTR", "Trainer.training_step no longer reads it"
    )


def test_trainer_scoring_methods_exist_on_every_trainer():
    classes = {"DPOTrainer": _dpo(), "OnlineDPOTrainer": _online()}
    assert set(_compat.TRAINER_SCORING_METHODS) == set(classes)  # GRPO and RLOO: no plugin scores them
    for trainer_class, names in _compat.TRAINER_SCORING_METHODS.items():
        for name in names:
            assert callable(getattr(classes[trainer_class], name, None)), _fail(
                "TRAINER_SCORING_METHODS", f"{trainer_class} has no `{name}`"
            )
    # Wrapped before TRL's `__init__` (`trl_ext.calls`): the precompute it runs, and the scoring methods it runs with.
    scoring = {name for names in _compat.TRAINER_SCORING_METHODS.values() for name in names}
    assert set(_compat.INIT_CALLS) == {_compat.DPO_PRECOMPUTE_METHOD, *scoring}
    precompute = _source(getattr(classes["DPOTrainer"], _compat.DPO_PRECOMPUTE_METHOD))
    assert "self.compute_ref_log_probs(" in precompute, _fail("INIT_CALLS", "the precompute scores otherwise")


def test_online_dpo_forward_truncates_the_prompt_on_the_left():
    forward = getattr(_online(), _compat.ONLINE_DPO_FORWARD_METHOD)
    assert _params(forward)[1:6] == ["model", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask"], _fail(
        "ONLINE_DPO_FORWARD_METHOD", f"signature is {_params(forward)}"
    )
    source = " ".join(_source(forward).split())
    limit = f"self.{_compat.ONLINE_DPO_MAX_LENGTH_ATTR}"
    rule = f"max(prompt_ids.size(1) + completion_ids.size(1) - {limit}, 0)"
    assert rule in source and "prompt_ids = prompt_ids[:, num_tokens_to_truncate:]" in source, _fail(
        "ONLINE_DPO_MAX_LENGTH_ATTR",
        "OnlineDPOTrainer._forward no longer cuts the prompt on the left to max_length",
    )  # toolkit.online_forward reproduces it and verifies that at attach: tests/plugins/test_online_forward.py


def test_trainer_state_attributes_are_the_named_ones():
    assert _compat.TRAINER_STATE_ATTRS == (
        _compat.TRAINER_LAST_LOGGED_ATTR,
        _compat.TRAINER_TOTAL_LOSS_ATTR,
        _compat.TRAINER_FLOS_ATTR,
    )  # each set by Trainer: test_trainer_members


def test_own_attention_alibi_and_chunked_model_facts():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in (*_compat.OWN_ATTENTION_MODEL_TYPES, *_compat.CHUNKED_MASK_MODEL_TYPES):
        assert model_type in CONFIG_MAPPING, _fail("OWN_ATTENTION/CHUNKED_MASK_MODEL_TYPES", f"no `{model_type}`")
    assert hasattr(CONFIG_MAPPING["mpt"](), _compat.MPT_ALIBI_TABLE_ATTR), _fail("MPT_ALIBI_TABLE_ATTR", "gone")
    chunked = inspect.getsource(importlib.import_module("transformers.models.llama4.modeling_llama4"))
    assert "create_chunked_causal_mask" in chunked and "position_ids" in chunked, _fail(
        "CHUNKED_MASK_MODEL_TYPES", "Llama-4 no longer builds its chunked mask from position_ids"
    )


def test_renamed_keywords_are_gone_from_trl():
    for trainer_class, renames in _compat.TRL_RENAMED_KEYWORDS.items():
        module, name = _compat.TRAINERS[trainer_class]
        params = _params(getattr(importlib.import_module(module), name).__init__)
        for old, new in renames.items():
            assert old not in params, _fail("TRL_RENAMED_KEYWORDS", f"{trainer_class} accepts `{old}` again")
            assert new in params, _fail("TRL_RENAMED_KEYWORDS", f"{trainer_class} has no `{new}`")


def test_every_fact_is_checked_here(report):
    """Every named fact of `_compat` (an upper-case constant) is used by a test in this module; prints the count."""
    facts = sorted(name for name in vars(_compat) if re.fullmatch(r"[A-Z][A-Z0-9_]+", name))
    source = inspect.getsource(importlib.import_module(__name__))
    unchecked = [name for name in facts if name not in source.replace("def test_every_fact_is_checked_here", "")]
    report(
        "compat",
        f"_compat facts checked against the installed versions: {len(facts) - len(unchecked)} of {len(facts)}",
    )
    assert unchecked == []


def test_verify_scoring_methods_side_effects_gathers_and_accelerate_autocast():
    """What `trl_ext.verify` relies on: the scoring method it checks in each trainer and its arguments, what DPO's
    `_compute_loss` changes besides its result and gathers, and accelerate keeping a model's own `forward` under its
    autocast wrapper."""
    from accelerate import Accelerator

    classes = {"DPOTrainer": _dpo(), "OnlineDPOTrainer": _online()}
    assert set(_compat.VERIFIED_SCORING_METHODS) == set(classes)
    for trainer_class, name in _compat.VERIFIED_SCORING_METHODS.items():
        assert name in _compat.TRAINER_SCORING_METHODS[trainer_class], _fail("VERIFIED_SCORING_METHODS", name)
    dpo_loss = getattr(classes["DPOTrainer"], _compat.VERIFIED_SCORING_METHODS["DPOTrainer"])
    assert _params(dpo_loss)[1:3] == ["model", "inputs"], _fail("VERIFIED_SCORING_METHODS", _params(dpo_loss))
    online = getattr(classes["OnlineDPOTrainer"], _compat.VERIFIED_SCORING_METHODS["OnlineDPOTrainer"])
    assert _params(online)[5] == "completion_mask", _fail("VERIFIED_SCORING_METHODS", _params(online))
    source = _source(dpo_loss)
    assert 'inputs["completion_mask"]' in source, _fail("VERIFIED_SCORING_METHODS", "no completion_mask")
    gathers = set(re.findall(r"self\.accelerator\.(\w*gather\w*)\(", source))
    assert gathers == set(_compat.VERIFY_LOCAL_GATHERS), _fail("VERIFY_LOCAL_GATHERS", sorted(gathers))
    assert all(callable(getattr(Accelerator, name, None)) for name in _compat.VERIFY_LOCAL_GATHERS)
    assert "self._metrics" not in _source(online) and "gather" not in _source(online)  # Online DPO: no side effects
    prepare = _source(Accelerator.prepare_model)
    assert f"model.{_compat.ACCELERATE_ORIGINAL_FORWARD} = model.forward" in prepare, _fail(
        "ACCELERATE_ORIGINAL_FORWARD", "accelerate no longer keeps the model's forward under its autocast wrapper"
    )
