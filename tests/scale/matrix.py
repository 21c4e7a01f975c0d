"""The scale matrix, as data: engines, cells and what each cell must do under each engine.

Read by the launched script (tests/scale/scripts/scale_matrix.py, which runs every cell of one engine in one launch)
and by tests/scale/test_scale_matrix.py (which launches it once per engine and asserts). A new plugin is one more
`Cell` row; a new engine is one more `Engine` row plus its arguments in the script's `engine_args`.

Every cell is compared with a stock-TRL cell (`baseline`) run in the same launch, under the same engine, on the same
model and data: float64 models, SGD with a constant learning rate and no gradient clipping, a few steps. Compared:
every logged value of every step (loss included) and the parameter update (final minus initial parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl_ext._compat import dpo_uses_fused_lm_head

WORLD = 2

#: The tiny model every cell trains (trl_ext.testing.make_model); 4 layers so that one FSDP2 unit is a small part of
#: the model (the generation memory check).
MODEL = dict(num_layers=4, seed=0)
#: The reference model is another seed: with the reference equal to the initial policy every reward of the first step
#: is exactly 0, and `rewards/accuracies` (a strict `>`) flips on the float32 rounding of precomputed log-probs.
REF_SEED = 1
DPO_PAIRS = 16  # 2 pairs per rank and step, 2 ranks: 4 steps per epoch, no uneven last batch
DPO_STEPS = 3
ONLINE_PROMPTS = 8
ONLINE_STEPS = 2


@dataclass(frozen=True)
class Engine:
    name: str
    #: relative tolerance on logged values and on the parameter update, and why
    rtol: float
    why: str
    deepspeed: bool = False


#: Why one tolerance fits every engine: each cell is compared with stock under the *same* engine, so the engine's own
#: reduction order (DDP buckets, ZeRO partitions and buckets, FSDP2 per-unit reduce-scatter) is the same on both sides
#: and cancels, and with bf16/fp16 off every engine trains the float64 model in float64 (asserted per cell). What is
#: left is the plugins' own rounding: the precompute plugin stores reference log-probs as float32, and TRL 1.16
#: computes per-token log-probs in float32 (trl/kernels/chunked_logprob.py). Measured worst over the matrix: trl 1.16,
#: 1.8e-7 on a logged value and 9.6e-8 on the parameter update; trl 1.12 (float64 log-probs, so the float32 storage
#: shows), 6.4e-7 (`logits/rejected`, a mean logit of ~5e-3) and 4.3e-7. 2e-6 keeps a 3x margin.
_WHY = "same engine on both sides (reduction order cancels), float64 kept; float32 storage of precomputed log-probs"

ENGINES = {
    e.name: e
    for e in (
        Engine("ddp", 2e-6, _WHY),
        Engine("zero2", 2e-6, _WHY + "; DeepSpeed with bf16/fp16 off keeps the float64 model", deepspeed=True),
        Engine("zero3", 2e-6, _WHY + "; ZeRO-3 partitions the float64 model as is", deepspeed=True),
        Engine("fsdp2", 2e-6, _WHY + "; no FSDP2 mixed-precision policy (bf16=False)"),
    )
}

EQUAL = "equal"
REFUSE = "refuse"


@dataclass(frozen=True)
class Expect:
    """What a cell must do under one engine: train to stock's result, or refuse with a `UsageError` matching
    `match` (a regex), or fail as a known bug (`xfail`, the reason naming file and line)."""

    kind: str = EQUAL
    match: str = ""
    xfail: str = ""


@dataclass(frozen=True)
class Cell:
    name: str
    trainer: str  # "dpo" or "online_dpo"
    flags: dict[str, Any] = field(default_factory=dict)  # trl_ext.install(**flags); empty: stock TRL
    options: dict[str, Any] = field(default_factory=dict)  # trl_ext.install(plugins=...)
    args: dict[str, Any] = field(default_factory=dict)  # extra DPOConfig / OnlineDPOConfig arguments
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra engine arguments (e.g. fsdp_config)
    baseline: str = ""  # the stock cell compared with; "" for a stock cell
    expect: dict[str, Expect] = field(default_factory=dict)  # engine -> Expect; engines not listed: not run
    #: logged keys that differ from stock on purpose (documented by the plugin), not compared
    by_design: tuple[str, ...] = ()
    #: a tolerance of the cell's own, instead of the engine's (0: the engine's), and why
    rtol: float = 0.0
    rtol_why: str = ""

    def tolerance(self, engine: str) -> float:
        return self.rtol or ENGINES[engine].rtol

    def runs_on(self, engine: str) -> bool:
        return engine in self.expect


ALL = {name: Expect() for name in ENGINES}


def _on(*engines: str, **special: Expect) -> dict[str, Expect]:
    out = {e: Expect() for e in engines}
    out.update(special)
    return out


FSDP2_GATHER_REFUSED = Expect(REFUSE, r"ds3_gather_for_generation.*FSDP2")

#: prompt_sharing computes a prompt token once for both responses, so its gradient is the sum of both branches'
#: *before* it flows back through Llama's RMSNorm, which runs in float32 even in a float64 model
#: (transformers/models/llama/modeling_llama.py `LlamaRMSNorm.forward`: `hidden_states.to(torch.float32)`); stock TRL
#: sums after. The forward is float64-exact (per-token log-probs equal to 3e-16, tests/plugins/
#: test_prompt_sharing_online.py), the gradients differ by float32 rounding (~6e-8), which DPO's chosen-minus-rejected
#: differences of log-prob sums amplify. Measured worst over the four engines, trl 1.16 and 1.12: 2.7e-6 (OnlineDPO
#: `grad_norm` at step 2, ZeRO-2); a prompt attended by the wrong branch moves these values by 1e-3 or more.
PROMPT_SHARING_RTOL = 1e-5
_PROMPT_SHARING_WHY = "float32 RMSNorm backward of a gradient summed over branches (see PROMPT_SHARING_RTOL)"

#: fused_logprobs cells use chunks far below the automatic size (4096 positions for this vocabulary), so that every
#: scoring call runs several chunks and the ranks' chunk counts differ with their completion lengths. Online DPO and
#: DPO on TRL < 1.15 run them inside the head module's one call per forward (ZeRO-3 and FSDP2 gather the head once,
#: as stock, and again before the backward's recomputation).
FUSED_CHUNK = 5
#: TRL >= 1.15 scores DPO with its own fused LM head: there the plugin leaves DPOTrainer as it is (asserted), below it
#: scores through its chunked head.
TRL_DPO_FUSED_HEAD = dpo_uses_fused_lm_head()


def _prompt_sharing(name: str, kind: str, baseline: str) -> Cell:
    """A prompt_sharing cell on every engine, within its round-off bound (`PROMPT_SHARING_RTOL`)."""
    flags = {"prompt_sharing": True}
    return Cell(
        name, kind, flags, baseline=baseline, expect=ALL, rtol=PROMPT_SHARING_RTOL, rtol_why=_PROMPT_SHARING_WHY
    )


def _fused(name: str, kind: str, baseline: str, *packing: str) -> Cell:
    """A fused_logprobs cell (chunk FUSED_CHUNK), with the packing plugins `packing` on too, on every engine."""
    flags = {"fused_logprobs": True, **dict.fromkeys(packing, True)}
    return Cell(name, kind, flags, options={"fused_logprobs": {"chunk": FUSED_CHUNK}}, baseline=baseline, expect=ALL)


#: token_budget cell: two pairs of this data (padded: `2 x pairs x longest`) fit together only when both are short, so
#: a step's 4 pairs (2 per rank) cut into 2 to 4 micro-batches, and with 3 one rank runs a zero-weight repeat.
TOKEN_BUDGET = 150

CELLS: tuple[Cell, ...] = (
    # -- DPO ---------------------------------------------------------------------------------------------------------
    # The reference is computed on the fly in the stock cell: under FSDP2, stock's own precompute runs on a reference
    # sharded before training (issue 18), and with an in-memory dataset it crashes on non-main ranks (bug B7), so
    # every precompute cell is compared with the on-the-fly reference (same values, up to float32 storage).
    Cell("dpo-stock", "dpo", expect=ALL),
    Cell("dpo-padding_free", "dpo", {"padding_free": True}, baseline="dpo-stock", expect=ALL),
    Cell(
        "dpo-precompute_int",
        "dpo",
        {"precompute_ref_batch_size": 3},
        args={"precompute_ref_log_probs": True},
        baseline="dpo-stock",
        expect=ALL,
    ),
    Cell(
        "dpo-precompute_auto",
        "dpo",
        {"precompute_ref_batch_size": "auto"},
        args={"precompute_ref_log_probs": True},
        baseline="dpo-stock",
        expect=ALL,
    ),
    Cell("dpo-sync_metrics", "dpo", {"sync_metrics": True}, baseline="dpo-stock", expect=ALL),
    # Each prompt computed once for its chosen and rejected response (the script records the plugin's shared calls).
    _prompt_sharing("dpo-prompt_sharing", "dpo", "dpo-stock"),
    Cell(
        "dpo-all",
        "dpo",
        {"padding_free": True, "precompute_ref_batch_size": 3, "sync_metrics": True},
        args={"precompute_ref_log_probs": True},
        baseline="dpo-stock",
        expect=ALL,
    ),
    # Micro-batches cut by TOKEN_BUDGET padded tokens over both ranks' pairs, balanced across ranks (pairs move); the
    # ranks run the same number, padded with zero-weight repeats (the script records the counts and moved pairs).
    Cell("dpo-token_budget", "dpo", {"token_budget": TOKEN_BUDGET}, baseline="dpo-stock", expect=ALL),
    # -- OnlineDPO ---------------------------------------------------------------------------------------------------
    Cell("online-stock", "online_dpo", expect=ALL),
    # Without ZeRO-3 there is nothing to gather: False only adds the exception-safe restore (and, under FSDP2, is
    # checked to mean what FSDP2 does: one unit unsharded at a time).
    Cell(
        "online-generation_false",
        "online_dpo",
        {"ds3_gather_for_generation": False},
        baseline="online-stock",
        expect=ALL,
    ),
    Cell(
        "online-generation_auto",
        "online_dpo",
        {"ds3_gather_for_generation": "auto"},
        baseline="online-stock",
        expect=_on("ddp", "zero2", "zero3", fsdp2=FSDP2_GATHER_REFUSED),
    ),
    Cell(
        "online-generation_true",
        "online_dpo",
        {"ds3_gather_for_generation": True},
        baseline="online-stock",
        expect=_on("zero3", fsdp2=FSDP2_GATHER_REFUSED),
    ),
    # Stock under FSDP2 with reshard_after_forward=False: generation then holds the whole model (measured), the reason
    # the plugin refuses `False` there.
    Cell("online-stock_no_reshard", "online_dpo", engine_args={"reshard_after_forward": False}, expect=_on("fsdp2")),
    Cell(
        "online-generation_false_no_reshard",
        "online_dpo",
        {"ds3_gather_for_generation": False},
        engine_args={"reshard_after_forward": False},
        baseline="online-stock",
        expect={"fsdp2": Expect(REFUSE, r"reshard_after_forward")},
    ),
    # Each prompt computed once for its two completions in the policy and reference scoring forwards.
    _prompt_sharing("online-prompt_sharing", "online_dpo", "online-stock"),
    Cell(
        "online-sync_metrics",
        "online_dpo",
        {"sync_metrics": True},
        baseline="online-stock",
        expect=ALL,
        # stock logs it from the local rank only (online_dpo_trainer.py 1.16.0:1266); the plugin logs the global value
        by_design=("val/contain_eos_token",),
    ),
    # -- fused_logprobs ----------------------------------------------------------------------------------------------
    # TRL < 1.15: policy and reference log-probs (and the policy's metrics) in chunks inside the head's call;
    # TRL >= 1.15: TRL's own fused head, left. Measured on trl 1.12 under all four engines: every logged value within
    # the 1e-12 absolute floor of stock's, the parameter update within 6.2e-16 relative.
    _fused("dpo-fused_logprobs", "dpo", "dpo-stock"),
    # TRL < 1.15 with a packing plugin: the head, inside its one call, reads the hidden states of the completion
    # positions from the packed row (the positions the plugin announces) and returns the padded log-probs. Compared
    # with the packing plugin alone: what differs is fused_logprobs. Measured on trl 1.12 under all four engines:
    # every logged value within the 1e-12 absolute floor, the parameter update within 6.2e-16 relative.
    _fused("dpo-fused_logprobs-padding_free", "dpo", "dpo-padding_free", "padding_free"),
    _fused("dpo-fused_logprobs-prompt_sharing", "dpo", "dpo-prompt_sharing", "prompt_sharing"),
    # Policy and reference completions scored FUSED_CHUNK positions at a time inside the head's call (the script
    # counts the head's calls and chunks, those recomputed in backward, and whether its weight was whole at each).
    _fused("online-fused_logprobs", "online_dpo", "online-stock"),
    # With prompt_sharing the model runs on packed rows: the head, inside its one call, reads the scored columns'
    # hidden states from the packed row (the positions prompt_sharing announces) and returns the padded log-probs.
    # Compared with prompt_sharing alone: what differs is fused_logprobs. Measured on trl 1.16 and 1.12 under all four
    # engines: every logged value within the 1e-12 absolute floor, the parameter update within 4.5e-17 relative.
    _fused("online-fused_logprobs-prompt_sharing", "online_dpo", "online-prompt_sharing", "prompt_sharing"),
)


def cells_for(engine: str) -> list[Cell]:
    return [c for c in CELLS if c.runs_on(engine)]


def cell(name: str) -> Cell:
    return next(c for c in CELLS if c.name == name)
