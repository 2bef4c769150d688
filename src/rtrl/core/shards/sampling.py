"""What a row's sampling columns mean, and which rows' log-probs the trainer can match.

The serving engine sampled each completion from the model's distribution at the request's
temperature, truncated by its top-p and top-k, and logged per token either the raw log-prob
(before temperature and truncation: vLLM's default ``--logprobs-mode raw_logprobs``) or
the log-prob of the distribution it actually sampled from (``processed_logprobs``). The
trainer weighs each token by ``exp(logp_old - logp_logged)``: that is an importance weight
only when the logged number is the behaviour distribution's. So:

- a null column means its neutral value: temperature 1, no top-p, no top-k, raw
  log-probs (a shard written before these columns existed, by an engine at its defaults);
- raw log-probs describe the sampling distribution only at temperature 1 without
  truncation; rows logged raw at another temperature or with truncation cannot be matched
  (:func:`unmatched`) and are refused, counted, never trained on;
- a temperature below :data:`GREEDY_TEMPERATURE` is greedy decoding (vLLM's rule): a
  deterministic choice has no log-prob to weigh against, so those rows are refused too;
- processed log-probs are matched at any temperature, top-p and top-k: the trainer
  computes its own under the same distribution (:mod:`rtrl_trainer.logprobs`).

Values no engine accepts (a negative or non-finite temperature, a top-p outside (0, 1], a
top-k below -1, a log-prob mode other than the two above) are a logging bug: the
validating reader quarantines those rows (:func:`check_sampling`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.shards.schema import OPTIONAL_SCHEMA

RAW_LOGPROBS = "raw_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"
LOGPROBS_MODES: tuple[str, ...] = (RAW_LOGPROBS, PROCESSED_LOGPROBS)
# vLLM samples greedily below this temperature (vllm/v1/sample/sampler.py _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5

# Validator reasons (rows quarantined by the validating reader).
SAMPLING_OUT_OF_RANGE = "sampling_out_of_range"
UNKNOWN_LOGPROBS_MODE = "unknown_logprobs_mode"

# Why a valid row's log-probs cannot be matched (rows refused by the stage and the eval's
# replay suite, counted, not quarantined: nothing is wrong with the data).
GREEDY = "greedy"
RAW_LOGPROBS_TEMPERED = "raw_logprobs_tempered"
RAW_LOGPROBS_TRUNCATED = "raw_logprobs_truncated"
UNMATCHED_REASONS: tuple[str, ...] = (GREEDY, RAW_LOGPROBS_TEMPERED, RAW_LOGPROBS_TRUNCATED)

BoolArray = npt.NDArray[np.bool_]


def _floats(array: pa.Array, fill: float) -> npt.NDArray[np.float64]:
    values: npt.NDArray[np.float64] = np.asarray(
        pc.fill_null(array.cast(pa.float64()), fill).to_numpy(zero_copy_only=False),
        dtype=np.float64,
    )
    return values


def _ints(array: pa.Array, fill: int) -> npt.NDArray[np.int64]:
    values: npt.NDArray[np.int64] = np.asarray(
        pc.fill_null(array.cast(pa.int64()), fill).to_numpy(zero_copy_only=False),
        dtype=np.int64,
    )
    return values


def _is_processed(array: pa.Array) -> BoolArray:
    mask: BoolArray = np.asarray(
        pc.fill_null(pc.equal(array, PROCESSED_LOGPROBS), False).to_numpy(zero_copy_only=False),
        dtype=np.bool_,
    )
    return mask


def out_of_range(batch: pa.RecordBatch) -> BoolArray | None:
    """Rows whose temperature, top_p or top_k no engine accepts (nulls pass); None when
    the batch has none of the columns' values set (the common case costs nothing)."""
    names = ("temperature", "top_p", "top_k")
    if all(batch.column(n).null_count == batch.num_rows for n in names):
        return None
    temperature = _floats(batch.column("temperature"), 1.0)
    top_p = _floats(batch.column("top_p"), 1.0)
    top_k = _ints(batch.column("top_k"), 0)
    with np.errstate(invalid="ignore"):
        bad: BoolArray = ~(np.isfinite(temperature) & (temperature >= 0))
        bad |= ~((top_p > 0) & (top_p <= 1))  # NaN fails both
        bad |= top_k < -1
    return bad


def unknown_mode(batch: pa.RecordBatch) -> BoolArray | None:
    """Rows whose ``logprobs_mode`` is neither :data:`LOGPROBS_MODES` (null passes)."""
    modes = batch.column("logprobs_mode")
    if modes.null_count == batch.num_rows:
        return None
    known = pc.is_in(modes, value_set=pa.array(LOGPROBS_MODES, pa.string()))
    mask: BoolArray = np.asarray(
        pc.fill_null(pc.invert(known), False).to_numpy(zero_copy_only=False), dtype=np.bool_
    )
    # is_in gives null for a null value: fill_null(False) keeps nulls passing.
    return mask & np.asarray(modes.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)


def truncates(
    top_p: npt.NDArray[np.float64], top_k: npt.NDArray[np.int64], vocab_size: int | None
) -> BoolArray:
    """Whether top-p or top-k removes any token: top_p below 1, or top_k at least 1 and
    below the vocabulary (vLLM disables a top-k of 0, -1, or the vocabulary or more)."""
    cut: BoolArray = top_p < 1
    limited = top_k >= 1
    if vocab_size is not None:
        limited &= top_k < vocab_size
    return cut | limited


def unmatched(batch: pa.RecordBatch, vocab_size: int | None = None) -> dict[str, BoolArray]:
    """Valid rows whose logged log-probs the trainer cannot match, per reason
    (:data:`UNMATCHED_REASONS`; a row is counted under its first reason only). Empty when
    every row can be matched. ``vocab_size``: the model's, when known (a top-k at or
    beyond it truncates nothing)."""
    names = ("temperature", "top_p", "top_k", "logprobs_mode")
    present = [n for n in names if n in batch.schema.names]
    if all(batch.column(n).null_count == batch.num_rows for n in present):
        return {}
    n = batch.num_rows

    def column(name: str) -> pa.Array:
        if name in present:
            return batch.column(name)
        return pa.nulls(n, OPTIONAL_SCHEMA.field(name).type)

    temperature = _floats(column("temperature"), 1.0)
    top_p = _floats(column("top_p"), 1.0)
    top_k = _ints(column("top_k"), 0)
    processed = _is_processed(column("logprobs_mode"))
    greedy = temperature < GREEDY_TEMPERATURE
    raw = ~processed & ~greedy
    tempered = raw & (temperature != 1.0)
    truncated = raw & ~tempered & truncates(top_p, top_k, vocab_size)
    found = {GREEDY: greedy, RAW_LOGPROBS_TEMPERED: tempered, RAW_LOGPROBS_TRUNCATED: truncated}
    return {reason: mask for reason, mask in found.items() if mask.any()}
