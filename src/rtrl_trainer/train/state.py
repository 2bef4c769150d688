"""What one run of the train step holds: its inputs, its rows and schedule, its progress.

Inputs are fetched once per node (by local rank 0) into scratch and verified against their
manifests; every rank agrees on any error before anyone goes on, so a bad row read by rank
3 stops all ranks with one message instead of leaving the others waiting in a collective.
The schedule is agreed from all ranks' row and token counts (batches.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rtrl.core.api.adapter import AdapterSpec
from rtrl.core.results import StageResult
from rtrl.core.shards.vocabulary import CONFIG_NAME, parse_config, vocab_size_of
from rtrl.core.store import MANIFEST_NAME, StoreError, open_store
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.stagedset import RESULT_NAME, TRAIN_DIR
from rtrl_trainer.train import adapter as lora
from rtrl_trainer.train.batches import (
    Schedule,
    make_schedule,
    most_micro_batches,
    row_lengths,
    step_tokens,
)
from rtrl_trainer.train.collectives import Ranks, TrainAbortError, agree, broadcast, gather, say
from rtrl_trainer.train.config import TrainConfig
from rtrl_trainer.train.examples import (
    DataError,
    Example,
    Skipped,
    assign_files,
    check_skipped,
    max_bad_fraction,
    read_rank,
)


@dataclass(frozen=True)
class Inputs:
    """What local rank 0 fetched and checked, shared with every rank.

    ``adapter``: the shape of the LoRA adapter to train (None: all weights). ``base``: the
    model under a parent that is itself an adapter (train/adapter.py); otherwise the
    parent is the model, and a fresh adapter goes on it."""

    parent: cio.Fetched
    data: cio.Fetched
    stage: StageResult
    vocab_size: int
    tokenizer_size: int | None
    adapter: AdapterSpec | None = None
    base: cio.Fetched | None = None

    @property
    def model(self) -> cio.Fetched:
        """The whole checkpoint whose weights are loaded (and, with an adapter, frozen)."""
        return self.base if self.base is not None else self.parent

    @property
    def parent_adapter(self) -> Path | None:
        """The directory of the adapter to continue (None: a fresh one, or none)."""
        return self.parent.directory if self.base is not None else None


@dataclass(frozen=True)
class Data:
    """This rank's rows, every rank's (rows, loss tokens, rows truncated), the schedule all
    ranks follow, each step's loss-token count over all ranks (its normaliser), and the
    rows all ranks skipped."""

    examples: list[Example]
    counts: list[tuple[int, int, int]]
    schedule: Schedule
    step_norms: list[int]
    skipped: Skipped = field(default_factory=Skipped)


@dataclass
class Progress:
    """What a resumed run needs of the interrupted one (saved with the DeepSpeed state)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    loop_seconds: float = 0.0
    input_tokens: float = 0.0
    earlier_wall_seconds: float = 0.0


def scratch_dir(config: TrainConfig) -> Path:
    """Node-local working directory of this run (same path for every rank of a node)."""
    if config.trainer.scratch_dir:
        base = Path(config.trainer.scratch_dir)
    elif os.environ.get("RTRL_SCRATCH"):
        base = Path(os.environ["RTRL_SCRATCH"])
    else:
        base = Path(tempfile.gettempdir()) / "rtrl-train"
    return base / hashlib.sha256(config.out.encode()).hexdigest()[:16]


def share_inputs(config: TrainConfig, ranks: Ranks, scratch: Path) -> Inputs:
    """The inputs, fetched by local rank 0 of each node, errors agreed, on every rank."""
    inputs: Inputs | None = None
    error = None
    if ranks.local_rank == 0:
        try:
            inputs = fetch_inputs(config, scratch)
        except (cio.InputError, DataError, StoreError) as exc:
            error = str(exc)
    agree(error)
    inputs = broadcast(inputs)
    assert inputs is not None
    inputs = replace(
        inputs,
        parent=replace(inputs.parent, directory=scratch / "parent"),
        data=replace(inputs.data, directory=scratch / "data"),
        base=replace(inputs.base, directory=scratch / "base") if inputs.base else None,
    )
    for note in inputs.model.notes:
        say(note)
    return inputs


def fetch_inputs(config: TrainConfig, scratch: Path) -> Inputs:
    """Download and check the staged set (first: an insufficient set stops the step
    before a large parent is downloaded) and the parent, and compare vocabularies."""
    data_store = open_store(config.data, endpoint_url=config.endpoint_url)
    manifest = data_store.committed("")
    if manifest is None:
        raise cio.InputError(
            f"staged training set {config.data}: not committed (no {MANIFEST_NAME}); "
            "treated as absent"
        )
    if RESULT_NAME not in manifest.files:
        raise cio.InputError(f"staged training set {config.data}: no {RESULT_NAME} in its manifest")
    cio.download(
        data_store,
        "",
        {RESULT_NAME: manifest.files[RESULT_NAME]},
        scratch / "data",
        label="staged training set",
        verify=True,
    )
    try:  # through the contract the stage step wrote it by (ResultError names the field)
        stage = StageResult.read(json.loads((scratch / "data" / RESULT_NAME).read_text()))
    except ValueError as exc:
        raise cio.InputError(f"staged training set {config.data}: {RESULT_NAME}: {exc}") from None
    if not stage.sufficient:
        raise DataError(
            f"staged training set {config.data} is marked insufficient "
            f"({stage.interactions_used} interactions, {stage.tokens_used} tokens): "
            "nothing to train on"
        )
    names = [n for n in manifest.files if n.startswith(f"{TRAIN_DIR}/")]
    data, _ = cio.fetch_committed(
        data_store, scratch / "data", label="staged training set", names=names
    )
    parent, base, adapter = _fetch_parent(config, scratch)
    label = f"base {base.uri}" if base is not None else f"parent {config.parent}"
    vocab_size, tokenizer_size = _vocabulary(label, base or parent)
    return Inputs(
        parent=parent,
        data=data,
        stage=stage,
        vocab_size=vocab_size,
        tokenizer_size=tokenizer_size,
        adapter=adapter,
        base=base,
    )


def _fetch_parent(
    config: TrainConfig, scratch: Path
) -> tuple[cio.Fetched, cio.Fetched | None, AdapterSpec | None]:
    """(the parent, the base under it when it is an adapter, the adapter shape to train).
    An adapter parent's base is the one its manifest names, with the files it was trained
    on (their digest), or the step stops: an adapter on another base computes something
    nobody measured (:func:`~rtrl_trainer.checkpoint_io.fetch_model`, as stage and eval
    fetch theirs)."""
    parent_store = open_store(config.parent, endpoint_url=config.endpoint_url)
    parent, base = cio.fetch_model(
        parent_store,
        scratch / "parent",
        label="parent",
        endpoint_url=config.endpoint_url,
        base_dest=scratch / "base",
    )
    if base is None:
        return parent, None, config.adapter
    label = f"parent adapter {parent_store.uri}"
    return parent, base, lora.resolve(config.adapter, lora.spec_of(parent.directory, label), label)


def _vocabulary(label: str, model: cio.Fetched) -> tuple[int, int | None]:
    """(the model's vocabulary size, the tokenizer's size if the model has one); a
    tokenizer larger than the vocabulary is an :class:`~cio.InputError`."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model.directory)
        # The vocabulary is read as the stage step and `rtrl shards validate --checkpoint`
        # read it, so the ids they passed are exactly the ids trained on here.
        raw = (model.directory / CONFIG_NAME).read_bytes()
        vocab_size = vocab_size_of(parse_config(raw))
    except (OSError, ValueError) as exc:
        raise cio.InputError(f"{label}: config.json is not usable ({exc})") from None
    if not cio.has_tokenizer(model.files):
        return vocab_size, None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model.directory)
    except (OSError, ValueError) as exc:
        raise cio.InputError(f"{label}: tokenizer cannot be loaded ({exc})") from None
    tokenizer_size = len(tokenizer)
    if tokenizer_size > vocab_size:
        raise cio.InputError(
            f"{label}: the tokenizer has {tokenizer_size} tokens but the "
            f"model's vocabulary (config.json vocab_size) has {vocab_size}: mismatched "
            "tokenizer"
        )
    return vocab_size, tokenizer_size


def load_data(config: TrainConfig, inputs: Inputs, ranks: Ranks, device: torch.device) -> Data:
    """This rank's rows (errors agreed), and the schedule every rank follows."""
    one_per_rank, files = assign_files(list(inputs.data.files), ranks.world_size)
    examples: list[Example] = []
    rows_truncated = 0
    skipped = Skipped()
    error = None
    try:
        rank_data = read_rank(
            [(name, inputs.data.directory / name) for name in files],
            rank=ranks.rank,
            world_size=ranks.world_size,
            one_per_rank=one_per_rank,
            vocab_size=inputs.vocab_size,
            max_sequence_length=config.training.max_sequence_length,
        )
        examples, rows_truncated = rank_data.examples, rank_data.rows_truncated
        skipped = rank_data.skipped
    except DataError as exc:
        error = str(exc)
    agree(error)
    counts = gather((len(examples), sum(e.tokens for e in examples), rows_truncated))
    # Every rank gets the same total, so every rank stops, or none.
    skipped = Skipped.merged(gather(skipped))
    try:
        check_skipped(skipped, max_bad_fraction(inputs.stage))
    except DataError as exc:
        raise TrainAbortError(f"staged training set {config.data}: {exc}") from None
    if skipped.rows:
        say(f"skipped {skipped.rows} row(s) that cannot be trained on: {skipped.examples[0]}")
    try:
        schedule = make_schedule(
            [c[0] for c in counts],
            sum(c[1] for c in counts),
            batch_tokens=config.training.batch_tokens,
            micro_batch_size=config.training.micro_batch_size,
            epochs=config.training.epochs,
            max_steps=config.trainer.max_steps,
            seed=config.training.seed,
        )
    except DataError as exc:
        raise TrainAbortError(f"staged training set {config.data}: {exc}") from None
    training = config.training
    budget = training.micro_batch_tokens or (
        training.max_sequence_length if training.pack_sequences else None
    )
    if budget is not None:
        # Micro-batches by tokens: how many a step needs depends on every rank's row
        # lengths; the most over all ranks is the accumulation every rank runs.
        width = min(budget, training.max_sequence_length) if training.pack_sequences else None
        schedule = replace(schedule, micro_batch_tokens=budget, packed=width)
        most = max(gather(most_micro_batches(row_lengths(examples), schedule, rank=ranks.rank)))
        schedule = replace(schedule, gradient_accumulation_steps=most)
    normalizers = torch.tensor(step_tokens(examples, schedule, rank=ranks.rank), device=device)
    dist.all_reduce(normalizers)
    step_norms = [max(1, int(n)) for n in normalizers.tolist()]
    return Data(
        examples=examples,
        counts=counts,
        schedule=schedule,
        step_norms=step_norms,
        skipped=skipped,
    )
