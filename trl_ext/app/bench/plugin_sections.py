"""The bench's sections for the plugins that change how a step is cut or scored: `token_budget` (against padding_free
at the same memory, and one step's loss, metrics and gradient against stock) and `fused_logprobs` (the Online DPO step
without generation against stock: time, peak memory, log-probs, loss and gradients).

Peak memory on CPU is the growth of the process's resident set during the measured call (the kernel's high-water mark,
reset before it; Linux only, else not reported).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from ..._shared import reset_peak_rss, rss_mib
from .sections import Setup, reference
from .stats import against, agreement, interleave, progress, ratios, summarize

#: Largest difference, token_budget against stock on the same optimizer step (fp32, padded against packed
#: micro-batches of another composition), relative to the largest |value|, that still counts as the same: the loss
#: and every logged metric, and the gradient (from one SGD step with learning rate 1 and no clipping).
BUDGET_RTOL = 1e-4
#: Largest difference, fused log-probs against stock (fp32: a chunked float32 log-sum-exp against a full
#: `log_softmax`), relative to the largest |value|, that still counts as the same: logged log-probs, loss, gradient.
FUSED_RTOL = 1e-4
#: A peak memory ratio up to this still counts as "the same memory" (resident-set high-water marks of a process whose
#: allocator keeps some freed memory are this noisy).
MEMORY_SLACK = 1.10


#: The sizes of both sections: `--quick`, and the default.
_SIZES: dict[bool, dict[str, Any]] = {
    True: dict(pairs_per_step=32, pair_batch=2, steps=1, vocab=32000, prompts=2, completion=128),
    False: dict(pairs_per_step=16, pair_batch=2, steps=4, vocab=32000, prompts=2, completion=512),
}


def _measured(call: Any, peaks: list[float | None], index: int) -> tuple[Any, float]:
    """`call()`'s result and seconds; its peak growth appended to `peaks` after the warm-up round (index 0)."""
    before = reset_peak_rss()
    start = time.perf_counter()
    result = call()
    elapsed = time.perf_counter() - start
    if index >= 1:
        peak = rss_mib("VmHWM")
        peaks.append(None if before is None or peak is None else peak - before)
    return result, elapsed


def _memory_ratio(peaks: dict[str, list[float | None]], this: str, base: str) -> tuple[float | None, float | None]:
    """The median peak of `this` over `base`'s (None where not measured or `base`'s is 0), and `base`'s median."""
    kept = {name: [v for v in peaks[name] if v is not None] for name in (this, base)}
    top, bottom = (statistics.median(kept[name]) if kept[name] else None for name in (this, base))
    return (top / bottom if top is not None and bottom else None), bottom


def relative_diff(a: dict[str, float], b: dict[str, float], keys: Any = None) -> float:
    """Largest |a - b| over the shared keys (those of `keys` only, when given), each relative to the larger |value| of
    the two but at least 1 (a metric near 0, e.g. a reward that is a difference of two log-probs, is compared
    absolutely). NaN if any is NaN."""
    worst = 0.0
    for key in sorted(set(a) & set(b) & set(a if keys is None else keys)):
        diff = abs(a[key] - b[key])
        if diff != diff:  # NaN never agrees
            return float("nan")
        worst = max(worst, diff / max(abs(a[key]), abs(b[key]), 1.0))
    return worst


def memory_verdict(ratio: float | None, baseline: str) -> dict[str, Any]:
    """Peak memory `this / baseline`: "less" below 1, "the same" up to `MEMORY_SLACK`, flagged above it."""
    if ratio is None:
        return {"ratio": None, "text": "peak memory not measured on this platform", "flags": []}
    if ratio > MEMORY_SLACK:
        text = f"MORE MEMORY: peak {ratio:.2f}x {baseline}'s (> {MEMORY_SLACK:.2f}x)"
        return {"ratio": ratio, "text": text, "flags": [text]}
    word = "less" if ratio < 1 / MEMORY_SLACK else "the same memory"
    return {"ratio": ratio, "text": f"peak {ratio:.2f}x {baseline}'s ({word})", "flags": []}


def _gradient_diff(grads_a: list[Any], grads_b: list[Any]) -> tuple[float, float]:
    """Largest |difference| between two lists of gradients and the largest |gradient| of the first."""
    diff = max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b, strict=True))
    scale = max(float(a.abs().max()) for a in grads_a)
    return diff, scale


# -------------------------------------------------------------------------------------------------------------------
# token_budget
# -------------------------------------------------------------------------------------------------------------------


def token_bound(trainer: Any, pairs: int) -> tuple[int, list[int]]:
    """The largest micro-batch, in real tokens, that `pairs` pairs per micro-batch form in the trainer's tokenized
    dataset in order (both sequences of a pair, the prompt counted in each, each cut at `max_length`); and each pair's
    tokens."""
    rows: Any = trainer.train_dataset
    cut = trainer.args.max_length
    sizes = []
    for i in range(len(rows)):
        prompt = len(rows[i]["prompt_ids"])
        lengths = [prompt + len(rows[i]["chosen_ids"]), prompt + len(rows[i]["rejected_ids"])]
        sizes.append(sum(min(n, cut) if cut else n for n in lengths))
    return max(sum(sizes[k : k + pairs]) for k in range(0, len(sizes), pairs)), sizes


def token_budget(setup: Setup, rounds: int, quick: bool) -> dict[str, Any]:
    """Whole `train()` runs, interleaved: padding_free with `pair_batch` pairs per micro-batch against token_budget
    (with padding_free's packing) bounded by the largest micro-batch padding_free forms on the same steps; both consume
    the same pairs per optimizer step in dataset order. Then one SGD step of stock TRL and of token_budget from the
    same weights: loss, metrics and gradient."""
    from trl import DPOTrainer

    import trl_ext

    z = _SIZES[quick]
    pairs, batch, steps = z["pairs_per_step"], z["pair_batch"], z["steps"]
    dataset = setup.dataset.select(range(pairs * steps))

    def build(label: str, flags: dict[str, Any], **overrides: Any) -> Any:
        options = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=pairs // batch, max_steps=steps)
        # Dataset order, so that the bound below is computed on the micro-batches padding_free really forms.
        options["train_sampling_strategy"] = "sequential"
        args = setup.dpo_args(f"token_budget-{label}", **{**options, **overrides})
        with trl_ext.install(**flags) if flags else contextlib.nullcontext():
            trainer = DPOTrainer(
                setup.model_fn(),
                ref_model=reference(setup),
                args=args,
                train_dataset=dataset,
                processing_class=setup.tokenizer,
            )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the logs of every timed run would bury the progress lines
        return trainer

    progress(f"token_budget: {pairs} pairs per step, {steps} step(s): padding_free {batch} pairs/micro-batch")
    fixed = build("padding_free", {"padding_free": True})
    bound = token_bound(fixed, batch)[0]
    cut = build("token_budget", {"padding_free": True, "token_budget": bound})
    trainers = {"padding_free": fixed, "token_budget": cut}
    peaks: dict[str, list[float | None]] = {name: [] for name in trainers}

    def arm(name: str):
        return lambda index: _measured(trainers[name].train, peaks[name], index)[1]

    times = interleave({name: arm(name) for name in trainers}, rounds=rounds, warmup=1, what="token_budget")
    state = cut._trl_ext.state["token_budget"]
    counts = state.micro_batch_counts[-steps:]
    largest = max(state.max_tokens[-steps:])

    progress("token_budget: one SGD step, stock TRL and token_budget, from the same weights")
    sgd = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant")
    results = {}
    for label, flags in (("stock", {}), ("trl_ext", {"padding_free": True, "token_budget": bound})):
        trainer = build(f"{label}-sgd", flags, **sgd)
        start = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        # SGD, learning rate 1, no clipping or decay: the update is minus the gradient.
        grads = [a - p.detach() for a, p in zip(start, trainer.model.parameters(), strict=True)]
        logged = {k: float(v) for k, v in trainer.state.log_history[0].items() if isinstance(v, int | float)}
        results[label] = (logged, grads)
    stock_logs, ext_logs = results["stock"][0], results["trl_ext"][0]
    metric_keys = sorted(k for k in set(stock_logs) & set(ext_logs) if k not in ("epoch", "step", "learning_rate"))
    metrics_diff = relative_diff(stock_logs, ext_logs, metric_keys)
    grad_diff, grad_scale = _gradient_diff(results["stock"][1], results["trl_ext"][1])
    del results

    memory, base_peak = _memory_ratio(peaks, "token_budget", "padding_free")
    memory_result = memory_verdict(memory, "padding_free")
    if memory is None and base_peak == 0:
        # The allocator served padding_free's train() from memory it already held: no growth to divide by.
        text = "NOT COMPARED: padding_free's train() did not grow the resident set (median 0 MiB)"
        memory_result = {"ratio": None, "text": text, "flags": [text]}
    return {
        "pairs_per_step": pairs,
        "pair_batch": batch,
        "steps": steps,
        "token_bound": bound,
        "largest_micro_batch_tokens": largest,
        "micro_batches_per_step": {"padding_free": pairs // batch, "token_budget": counts},
        "padding_free": {"train_seconds": times["padding_free"], "peak_mb": peaks["padding_free"]},
        "trl_ext": {"train_seconds": times["token_budget"], "peak_mb": peaks["token_budget"]},
        "speedup": against(summarize(ratios(times, "padding_free", "token_budget")), "padding_free"),
        "memory": memory_result,
        "bound": bound_verdict(largest, bound),
        "metric_keys": metric_keys,
        "metrics": agreement(metrics_diff, BUDGET_RTOL, "loss and metrics"),
        "max_abs_grad": grad_scale,
        "gradient": agreement(grad_diff, BUDGET_RTOL * grad_scale, "gradient"),
    }


def bound_verdict(largest: int, bound: int) -> dict[str, Any]:
    """Whether token_budget's largest micro-batch stayed within its bound (a pair over it would run alone)."""
    same = largest <= bound
    text = f"largest micro-batch {largest} <= bound {bound} tokens"
    if not same:
        text = f"OVER THE BOUND: largest micro-batch {largest} > {bound} tokens (a pair longer than the bound)"
    return {"same": same, "text": text, "flags": [] if same else [text]}


# -------------------------------------------------------------------------------------------------------------------
# fused_logprobs
# -------------------------------------------------------------------------------------------------------------------


def _online_trainer(setup: Setup, label: str, z: dict[str, Any]) -> Any:
    """`stored_online_trainer` on the setup's model shape, prompts of 80 to 120 tokens, one step."""
    import random

    from .device_workload import stored_online_trainer
    from .workload import make_model

    vocab, rng = z["vocab"], random.Random(0)
    models = (make_model(vocab_size=vocab, seed=0, **setup.shape), make_model(vocab_size=vocab, seed=1, **setup.shape))
    lengths = [rng.randint(80, 120) for _ in range(z["prompts"])]
    # ids the tokenizer decodes for the reward
    words, out = min(vocab, len(setup.tokenizer)), str(setup.out / "runs" / f"fused_logprobs-{label}")
    return stored_online_trainer(
        models, setup.tokenizer, lengths, words, z["completion"], output_dir=out, max_steps=1, use_cpu=True
    )


def fused_logprobs(setup: Setup, rounds: int, quick: bool) -> dict[str, Any]:
    """`OnlineDPOTrainer.training_step` with generation replaced by a stored batch, stock against
    `fused_logprobs`, interleaved (one warm-up round); the logged log-probs, the loss and the gradients of both from
    the same weights (a step computes gradients and leaves the weights alone)."""
    import trl_ext

    z = _SIZES[quick]
    progress(
        f"fused_logprobs: Online DPO step without generation, vocab {z['vocab']}, {2 * z['prompts']} completions of "
        f"up to {z['completion']} tokens: stock and fused_logprobs"
    )
    stock = _online_trainer(setup, "stock", z)
    with trl_ext.install(fused_logprobs=True):
        fused = _online_trainer(setup, "fused", z)
    trainers = {"stock": stock, "trl_ext": fused}
    peaks: dict[str, list[float | None]] = {name: [] for name in trainers}
    first: dict[str, tuple[dict[str, float], list[Any]]] = {}

    def arm(name: str):
        def run(index: int) -> float:
            import torch

            trainer = trainers[name]
            trainer.model.train()
            trainer.model.zero_grad(set_to_none=True)
            for values in trainer.stats.values():
                values.clear()
            batch = {"prompt": ["w1"] * z["prompts"]}
            loss, elapsed = _measured(lambda: trainer.training_step(trainer.model, batch), peaks[name], index)
            trainer.state.global_step += 1  # as train() does: `verify` checks the first step only
            if name not in first:
                logged = {key: float(values[-1]) for key, values in trainer.stats.items() if values}
                logged["loss"] = float(loss.detach())
                grads = [
                    torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                    for p in trainer.model.parameters()
                ]
                first[name] = (logged, grads)
            return elapsed

        return run

    times = interleave({name: arm(name) for name in trainers}, rounds=rounds, warmup=1, what="fused_logprobs")
    (stock_logs, stock_grads), (ext_logs, ext_grads) = first["stock"], first["trl_ext"]
    logps_diff = relative_diff(stock_logs, ext_logs, [k for k in stock_logs if k.startswith("logps/")])
    metric_keys = sorted(set(stock_logs) & set(ext_logs))
    metrics_diff = relative_diff(stock_logs, ext_logs)
    grad_diff, grad_scale = _gradient_diff(stock_grads, ext_grads)
    memory = _memory_ratio(peaks, "trl_ext", "stock")[0]
    return {
        "vocab": z["vocab"],
        "completions": 2 * z["prompts"],
        "completion_width": z["completion"],
        "stock": {"step_seconds": times["stock"], "peak_mb": peaks["stock"], "logged": first["stock"][0]},
        "trl_ext": {"step_seconds": times["trl_ext"], "peak_mb": peaks["trl_ext"], "logged": first["trl_ext"][0]},
        "speedup": summarize(ratios(times, "stock", "trl_ext")),
        "memory": memory_verdict(memory, "stock"),
        "logps": agreement(logps_diff, FUSED_RTOL, "log-probs"),
        "metric_keys": metric_keys,
        "metrics": agreement(metrics_diff, FUSED_RTOL, "loss and metrics"),
        "max_abs_grad": grad_scale,
        "gradient": agreement(grad_diff, FUSED_RTOL * grad_scale, "gradient"),
    }
