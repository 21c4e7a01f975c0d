"""Architecture sweep (`tests/plugins/sweep.py`): every causal-LM type of the installed transformers, built as a tiny
float64 model and classified for padding_free and prompt_sharing as exact (DPO loss, per-sequence log-probs, MoE
auxiliary loss and gradients equal to the stock padded forward within 1e-6) or refused (`UsageError` with the reason);
types that are not text decoders are excluded by a computed rule and counted. A decoder that does not build, crashes
or differs fails.

The quick loop runs a named set; the whole sweep (`slow`, in the default run) builds each type once per session
(`sweep.row` caches), prints its counts at the end of the run, and checks `docs/architectures.md` and the counts in
`docs/plugins/padding_free.md` against what it computed. `python tests/plugins/sweep.py --markdown
docs/architectures.md` regenerates the table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.plugins import sweep
from tests.plugins.sweep import AUX_COEF, REL, build_tiny, no_dropout  # noqa: F401 - imported by other test modules
from trl_ext.plugins.padding_free.hooks import VERIFIED_MODEL_TYPES

_SMALL = sweep._SMALL  # the same dict: tests that need another vocabulary patch it here
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "architectures.md"
PAGE = ROOT / "docs" / "plugins" / "padding_free.md"  # states the sweep counts
# The quick loop's set: dense, sliding windows mixed with full layers, QK-norm, MoE with the auxiliary loss, sinks,
# softcapping, learned positions, a stateful mixer, a hybrid Mamba model and a latent-attention MoE.
NAMED = (
    "qwen2",
    "llama",
    "cohere2",
    "olmo3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gpt2",
    "lfm2",
    "nemotron_h",
    "deepseek_v3",
)


#: A refusal that only reports a crash: an exception other than the plugins' own `UsageError` (which names its
#: mechanism), caught by a self-check. The sweep's architectures each get a refusal that names the layer or feature.
CRASH = re.compile(r"raised (?!UsageError)\w+(Error|Exception)\b")


def _assert_classified(row: sweep.Row) -> None:
    """Both plugins' outcomes are exact or refused; a refusal says why, naming a mechanism, not a crash."""
    assert row.excluded is None, row.excluded
    for plugin, outcome in (("padding_free", row.padding_free), ("prompt_sharing", row.prompt_sharing)):
        assert outcome is not None
        assert outcome.status in ("exact", "refused"), f"{row.model_type} {plugin} [{row.mechanism}]: {outcome.detail}"
        if outcome.status == "refused":
            assert "``" not in outcome.detail, f"{row.model_type} {plugin}: the refusal names an empty layer"
            assert len(outcome.detail) > 40, f"{row.model_type} {plugin}: {outcome.detail}"
            assert not CRASH.search(outcome.detail), f"{row.model_type} {plugin}: a crash, no mechanism named"


def test_enumerates_the_installed_architectures():
    types = sweep.causal_lm_types()
    assert len(types) > 100 and set(NAMED) <= set(types)


def test_exclusion_rules():
    """Only types whose causal-LM class is not a text decoder are excluded, each by a computed rule."""
    assert sweep.exclusion("bart").startswith("encoder-decoder")
    assert sweep.exclusion("gemma3").startswith("not text-only")
    assert sweep.exclusion("gemma4_assistant").startswith("assistant model")
    for model_type in ("llama4", "gemma3_text", "mllama", "bert"):  # text decoders (or run as one), built
        assert sweep.exclusion(model_type) is None


@pytest.mark.parametrize("model_type", NAMED)
def test_named_architectures(model_type):
    row = sweep.row(model_type)
    _assert_classified(row)
    if model_type in VERIFIED_MODEL_TYPES:
        assert row.padding_free.status == "exact", row.padding_free.detail


#: Refusals that once were crashes or false (`docs/architectures.md` before): each names its layer and mechanism now,
#: for both plugins; `None` marks an exact outcome.
NAMED_MECHANISMS = {
    "deepseek_v32": ("`model.layers.0.self_attn.indexer` (DeepseekV32Indexer) is a sparse-attention indexer",) * 2,
    "glm_moe_dsa": ("`model.layers.0.self_attn.indexer` (GlmMoeDsaIndexer) is a sparse-attention indexer",) * 2,
    "dots3_note_text": ("(Dots3NoteTextIndexer) is a sparse-attention indexer",) * 2,
    "deepseek_v4": ("`model.layers.0.self_attn.compressor` (DeepseekV4HCACompressor) compresses the key/value",) * 2,
    "blt": ("`model.global_transformer` (BltGlobalTransformer) is part of a byte-patch model",) * 2,
    "cpmant": ("`cpmant` (CpmAntModel) prepends `prompt_length=32` learned prompt tokens",) * 2,
    "roberta": ("`roberta.embeddings` (RobertaEmbeddings) numbers each row's real tokens from the padding id on",) * 2,
    "xlnet": ("`transformer.layer.0.rel_attn` (XLNetRelativeAttention) computes attention in its own module",) * 2,
    "xlm": ("`transformer.attentions.0` (MultiHeadAttention) computes attention in its own module",) * 2,
    "llama4_text": (None, "applies chunked attention (`attention_chunk_size=4`) only through the attention mask"),
    "phimoe": (None, "draws random numbers in training mode, in `model.layers.0.mlp.router` (PhimoeTopKRouter)"),
    "dbrx": (None, None),  # its expert count sits in `ffn_config`: the self-check's MoE round-off applies
    "vaultgemma": (None, None),  # prompt_sharing's NaN padded probe rows take their reference from the row alone
}


#: Five of them are `slow`, the costliest: the whole sweep checks every row's outcomes and reasons against
#: docs/architectures.md (`test_docs_match_the_sweep`). The fast loop keeps the other eight (sparse-attention indexers,
#: learned prompt tokens, positions numbered from the padding id, attention in its own module, chunked attention,
#: random routing).
_SWEEP_ONLY = {"dbrx", "vaultgemma", "deepseek_v4", "blt", "xlnet"}


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=pytest.mark.slow) if t in _SWEEP_ONLY else t for t in sorted(NAMED_MECHANISMS)],
)
def test_former_crashes_and_false_refusals(model_type):
    row = sweep.row(model_type)
    _assert_classified(row)
    for outcome, expected in zip((row.padding_free, row.prompt_sharing), NAMED_MECHANISMS[model_type], strict=True):
        if expected is None:
            assert outcome.status == "exact", outcome.detail
        else:
            assert outcome.status == "refused" and expected in outcome.detail, outcome.detail


def test_chunks_longer_than_training_are_shared_exactly(monkeypatch):
    """Llama 4's chunked attention never acts on sequences no longer than a chunk (stock or shared): with chunks of 64
    tokens and `max_length` 12, prompt_sharing admits the model through its self-check and is exact."""
    monkeypatch.setitem(_SMALL, "attention_chunk_size", 64)
    with sweep.single_thread_float64():
        row = sweep.sweep_row("llama4_text")
    assert row.prompt_sharing.status == "exact", row.prompt_sharing.detail


def test_the_architecture_table_has_no_crash_refusal():
    """docs/architectures.md (the sweep's table, checked against the sweep by `test_docs_match_the_sweep`): every
    refusal names a mechanism; none only reports an exception (fast: reads the committed table)."""
    rows, _ = sweep.parse_markdown(DOCS.read_text())
    assert len(rows) > 150
    crashes = {t: c for t, cells in rows.items() for c in cells if CRASH.search(c)}
    assert crashes == {}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sweep.causal_lm_types())
def test_every_causal_lm_type(model_type):
    """A text decoder is built and classified for both plugins; any other type is excluded by a computed rule."""
    if sweep.exclusion(model_type) is not None:
        row = sweep.row(model_type)
        assert row.excluded and row.padding_free is None and row.prompt_sharing is None
        return
    _assert_classified(sweep.row(model_type))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_verified_table(model_type):
    """Every model type that skips padding_free's self-check by default is exact in the sweep."""
    row = sweep.row(model_type)
    assert row.padding_free.status == "exact", f"{row.mechanism}: {row.padding_free.detail}"


class _Summary:
    """Prints the sweep's counts in the terminal summary of the run."""

    def __init__(self, line: str) -> None:
        self.line = line

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("-", "architecture sweep")
        terminalreporter.write_line(self.line)


@pytest.fixture(scope="session")
def rows(request):
    """Every type's row (computed once; the per-type tests above fill the same cache), its counts printed at the end
    of the run."""
    result = [sweep.row(t) for t in sweep.causal_lm_types()]
    manager = request.config.pluginmanager
    if not manager.has_plugin("trl_ext_sweep_summary"):
        manager.register(_Summary(sweep.summary(result)), "trl_ext_sweep_summary")
    return result


@pytest.mark.slow
def test_sweep_counts(rows):
    """0 not built, 0 failing: every type is a classified decoder or an excluded non-decoder."""
    counts = sweep.counts(rows)
    print(sweep.summary(rows))
    assert counts["decoders"] + counts["excluded"] == counts["types"] == len(sweep.causal_lm_types())
    assert counts["padding_free FAIL"] == counts["prompt_sharing FAIL"] == 0, [
        (r.model_type, [o.detail for o in r.outcomes if o.status == "FAIL"])
        for r in rows
        if any(o.status == "FAIL" for o in r.outcomes)
    ]
    for plugin in ("padding_free", "prompt_sharing"):
        assert counts[f"{plugin} exact"] + counts[f"{plugin} refused"] == counts["decoders"]
    assert counts["excluded"] < counts["decoders"] / 4  # the rules exclude non-decoders, not the hard cases


@pytest.mark.slow
def test_docs_match_the_sweep(rows):
    """docs/architectures.md is what the sweep computes now: the transformers version, the counts and every row
    (type, mechanisms, each plugin's outcome and reason; numbers in reasons, round-off of the machine, masked)."""
    expected = sweep.markdown(rows)
    committed = DOCS.read_text()
    want_rows, want_counts = sweep.parse_markdown(expected)
    have_rows, have_counts = sweep.parse_markdown(committed)
    import transformers

    version = f"transformers {transformers.__version__}:"
    if version in committed and want_counts == have_counts and want_rows == have_rows:
        return
    differing = sorted(t for t in want_rows.keys() | have_rows.keys() if want_rows.get(t) != have_rows.get(t))
    details = [f"{t}: docs {have_rows.get(t)} / sweep {want_rows.get(t)}" for t in differing[:10]]
    pytest.fail(
        "docs/architectures.md disagrees with the sweep; regenerate it with `python tests/plugins/sweep.py --markdown "
        f"docs/architectures.md`.\ncounts: docs {have_counts!r}\n        sweep {want_counts!r}\n" + "\n".join(details)
    )


@pytest.mark.slow
def test_readme_states_the_sweep_counts(rows):
    """The sentence on the sweep in padding_free's page carries the counts the sweep computes."""
    counts = sweep.counts(rows)
    text = " ".join(PAGE.read_text().split())
    match = re.search(
        r"every causal-LM type of transformers ([\d.]+) \((\d+)\): (\d+) text decoders, all built; padding_free: "
        r"(\d+) exact, (\d+) refused; prompt_sharing: (\d+) exact, (\d+) refused; (\d+) excluded",
        text,
    )
    assert match, "docs/plugins/padding_free.md: the sentence stating the architecture sweep's counts is missing"
    import transformers

    stated = [match.group(1), *map(int, match.groups()[1:])]
    computed = [
        transformers.__version__,
        counts["types"],
        counts["decoders"],
        counts["padding_free exact"],
        counts["padding_free refused"],
        counts["prompt_sharing exact"],
        counts["prompt_sharing refused"],
        counts["excluded"],
    ]
    assert stated == computed


# -------------------------------------------------------------------------------------------------------------------
# Gradient checkpointing and training-only refusals on the packed path
# -------------------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_verified_table_gradient_checkpointing(model_type):
    """Packed with gradient checkpointing equals padded without it. Checkpointing recomputes each layer during the
    backward, outside the packed call; a layer that drops `cu_seq_lens_q` on the way to its attention (StableLM) must
    find the same sequence bounds there (it raised `CheckpointError` before the bounds were read off the packed
    `position_ids`)."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins.padding_free.hooks import inspect_model

    model = build_tiny(model_type)
    if not model.supports_gradient_checkpointing:  # transformers refuses it for this model, packed or not
        with pytest.raises(ValueError, match="does not support"):
            model.gradient_checkpointing_enable()
        return
    no_dropout(model)
    model.train()
    moe = sweep.is_moe(model, inspect_model(model).mechanisms)
    ids, mask = sweep.padded_batch(sweep.token_range(model))
    stock = sweep.dpo_loss_and_grads(model, model.forward, ids, mask, moe)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = pf.PaddingFreeState()
    with sweep.packed_forward(model, state) as forward:
        packed = sweep.dpo_loss_and_grads(model, forward, ids, mask, moe)
    assert state.packed_calls == 1
    assert (packed.aux is None) == (stock.aux is None)
    assert sweep.differences(stock, packed) == []


def test_position_ids_that_hide_the_packed_bounds_are_refused_in_training():
    """StableLM's layer drops `cu_seq_lens_q`: a recomputed layer splits the row where the position_ids restart.
    Position ids that run on across sequences would split it elsewhere, so training refuses them up front."""
    from trl_ext import UsageError
    from trl_ext.plugins import padding_free as pf

    model = build_tiny("stablelm")
    no_dropout(model)
    model.train()
    ids, mask = sweep.padded_batch(model.config.vocab_size)
    rows, length = ids.shape
    with sweep.packed_forward(model, pf.PaddingFreeState()) as forward:
        running_on = torch.arange(rows * length).view(rows, length)  # row 1 continues row 0 (12 tokens, no padding)
        with pytest.raises(UsageError, match="do not restart at every packed sequence"):
            forward(input_ids=ids, attention_mask=mask, position_ids=running_on, use_cache=False)
        restarting = torch.arange(length).expand(rows, length)
        out = forward(input_ids=ids, attention_mask=mask, position_ids=restarting, use_cache=False)
    stock = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(out.logits[real], stock[real], rtol=REL, atol=0)
