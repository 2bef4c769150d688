"""The capture contract: what the serving side writes and the seal step reads.

Interactions reach training in three hops, each written by a different process:

1. The capture proxy (``rtrl-capture``, a sidecar in front of the inference engine) writes
   one *generation event* per completion it served: token ids, the engine's log-probs, the
   sampling parameters, the checkpoint and arm that served it (:data:`GENERATION_SCHEMA`),
   under ``<events>/generations/date=/hour=/`` of the hour it was served.
2. The feedback service (``rtrl-feedback``) writes *feedback events*: one signal of one
   interaction, observed by a client minutes to hours later (:data:`FEEDBACK_SCHEMA`), under
   ``<events>/feedback/date=/hour=/`` of the hour **the interaction** was served, which its
   id tells (:mod:`~rtrl.core.events.ids`), so the seal of an hour reads one partition.
3. The seal step (``rtrl-job seal``) joins an hour's generations with their feedback once
   every signal's maturity (:mod:`~rtrl.core.events.signals`) has passed, and writes the
   interaction shards the stage reads, with a marker per sealed hour
   (:mod:`~rtrl.core.events.layout`); a reader of sealed data lists only the files the
   markers name (:mod:`~rtrl.core.events.sealed`).

Every file name is deterministic (writer id and sequence number), so a retried upload
replaces itself instead of adding a copy; the seal deduplicates by interaction id and by
feedback event id whatever happens upstream.
"""

from rtrl.core.events.ids import InteractionIdError, new_interaction_id, served_at
from rtrl.core.events.layout import (
    FEEDBACK_DIR,
    GENERATIONS_DIR,
    SEALED_DIR,
    SealMarker,
    event_file_key,
    hour_of,
    hour_partition,
    parse_hour_partition,
    seal_marker_key,
    sealed_shard_prefix,
)
from rtrl.core.events.schema import (
    FEEDBACK_SCHEMA,
    GENERATION_SCHEMA,
    SAMPLING_COLUMNS,
)
from rtrl.core.events.sealed import SealedView
from rtrl.core.events.signals import SIGNALS, Signal, SignalValueError, parse_signal_value

__all__ = [
    "FEEDBACK_DIR",
    "FEEDBACK_SCHEMA",
    "GENERATIONS_DIR",
    "GENERATION_SCHEMA",
    "SAMPLING_COLUMNS",
    "SEALED_DIR",
    "SIGNALS",
    "InteractionIdError",
    "SealMarker",
    "SealedView",
    "Signal",
    "SignalValueError",
    "event_file_key",
    "hour_of",
    "hour_partition",
    "new_interaction_id",
    "parse_hour_partition",
    "parse_signal_value",
    "seal_marker_key",
    "sealed_shard_prefix",
    "served_at",
]
