"""Publishing the new checkpoint: rank 0 writes a Hugging Face checkpoint, the parent's
tokenizer files and train.json, and commits them with the manifest last.

The published logits are probed on a fixed input and hashed into train.json, so whoever
loads the checkpoint can prove it computes exactly what the trainer's engine computed.
Every rank ends with rank 0's outcome, so all pods of the Job succeed or fail together.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rtrl.core.api.adapter import base_digest
from rtrl.core.api.checkpoint import TrainingSummary
from rtrl.core.results import TrainResult
from rtrl.core.store import ObjectStore, StoreError
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.train import adapter as lora
from rtrl_trainer.train.collectives import Ranks, agree, gather, say
from rtrl_trainer.train.config import TrainConfig, describe
from rtrl_trainer.train.hostmem import process_peak_bytes
from rtrl_trainer.train.state import Data, Inputs, Progress

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

PROBE_LENGTH = 32


def publish_checkpoint(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    config: TrainConfig,
    inputs: Inputs,
    data: Data,
    progress: Progress,
    ranks: Ranks,
    device: torch.device,
    dropout: dict[str, float],
    start_step: int,
    started: float,
    load_memory: dict[str, Any],
) -> None:
    """Publish from rank 0 (ZeRO-3: the weights gathered from every rank first), delete
    the DeepSpeed state unless asked to keep it, and agree on the outcome."""
    probe = probe_logits(engine, inputs.vocab_size, device)
    memory = host_memory(gather({**load_memory, "process_peak": process_peak_bytes()}))
    zero3 = config.training.zero_stage == 3
    # ZeRO-3: every rank holds a shard; gathered layer by layer onto rank 0 (a collective).
    state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
    error = None
    if ranks.is_main:
        doc = train_document(
            config,
            inputs,
            data,
            progress,
            world_size=ranks.world_size,
            device=device,
            start_step=start_step,
            probe=probe,
            wall_seconds=progress.earlier_wall_seconds + time.time() - started,
            host_memory=memory,
            adapter=adapter_document(inputs, engine.module),
        )
        try:
            publish(
                engine,
                store,
                scratch,
                inputs=inputs,
                dropout=dropout,
                doc=doc,
                state_dict=state_dict,
                config=config,
            )
        except (StoreError, OSError) as exc:
            error = f"publishing {config.out} failed: {exc}"
        if error is None and not config.trainer.keep_deepspeed_state:
            try:
                delete_leftover_state(store)
            except StoreError as exc:
                # The checkpoint is committed; a rerun (a no-op) deletes what is left.
                say(f"could not delete {store.url(cio.STATE_PREFIX)}/: {exc}")
    agree(error)


@torch.no_grad()
def probe_logits(engine: DeepSpeedEngine, vocab_size: int, device: torch.device) -> dict[str, Any]:
    """The engine's logits on a fixed input, hashed (see the module docstring)."""
    ids = [(7 * i + 3) % vocab_size for i in range(PROBE_LENGTH)]
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        logits = engine(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
    finally:
        module.train(was_training)
    host = logits.float().cpu().contiguous()
    return {
        "input_ids": ids,
        "logits_sha256": hashlib.sha256(host.numpy().tobytes()).hexdigest(),
        "logits_shape": list(host.shape),
        "dtype": str(logits.dtype).removeprefix("torch."),
    }


def host_memory(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """train.json's ``run.host_memory``: every rank's report (engine.memory_report, and
    the process's peak at publishing) and the most of each figure over the ranks."""
    keys = ("load_peak", "load_growth", "initialize_peak", "initialize_growth", "process_peak")
    most = {f"max_{key}": max(r[key] for r in per_rank) for key in keys}
    return {**most, "per_rank": per_rank}


def train_document(
    config: TrainConfig,
    inputs: Inputs,
    data: Data,
    progress: Progress,
    *,
    world_size: int,
    device: torch.device,
    start_step: int,
    probe: dict[str, Any],
    wall_seconds: float,
    host_memory: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
) -> TrainResult:
    """train.json: the summary the operator puts on the Checkpoint (TrainingSummary) and
    the details behind it."""
    history = progress.history
    tokens = sum(h.get("tokens", 0.0) for h in history)
    schedule, counts = data.schedule, data.counts

    def weighted(key: str) -> float | None:
        return (
            sum(h[key] * h["tokens"] for h in history if h.get("tokens")) / tokens
            if tokens
            else None
        )

    last = history[-1] if history else {}
    summary = TrainingSummary(
        steps=len(history),
        tokens=int(tokens),
        loss=last.get("loss"),
        kl=last.get("kl"),
        clip_fraction=weighted("clip_fraction"),
        truncation_fraction=weighted("truncation_fraction"),
        mean_advantage=weighted("mean_advantage"),
        grad_norm=last.get("grad_norm"),
        tokens_per_second=tokens / progress.loop_seconds if progress.loop_seconds > 0 else None,
        wall_seconds=wall_seconds,
    )
    return TrainResult(
        summary=summary,
        parent={
            "uri": inputs.parent.uri,
            "manifest": inputs.parent.manifest,
            "files": inputs.parent.files,
        },
        data={
            "uri": inputs.data.uri,
            "files": inputs.data.files,
            "rows": sum(c[0] for c in counts),
            "loss_tokens": sum(c[1] for c in counts),
            "rows_truncated": sum(c[2] for c in counts),
            **data.skipped.to_dict(),
            "stage": {
                "interactions_used": inputs.stage.interactions_used,
                "tokens_used": inputs.stage.tokens_used,
            },
        },
        config=describe(config),
        run={
            "world_size": world_size,
            "device": device.type,
            "steps_per_epoch": schedule.steps_per_epoch,
            "total_steps": schedule.total_steps,
            "gradient_accumulation_steps": schedule.gradient_accumulation_steps,
            "resumed_from_step": start_step or None,
            "input_tokens": int(progress.input_tokens),
            "input_tokens_per_second": (
                progress.input_tokens / progress.loop_seconds if progress.loop_seconds else None
            ),
            "loop_seconds": progress.loop_seconds,
            "host_memory": host_memory,
        },
        history=history,
        probe=probe,
        adapter=adapter,
        finished_at=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    )


def adapter_document(inputs: Inputs, module: Any) -> dict[str, Any] | None:
    """train.json's ``adapter``: its shape, how many parameters it trained, and the base it
    runs on (None when all weights were trained)."""
    if inputs.adapter is None:
        return None
    return {
        **inputs.adapter.model_dump(mode="json"),
        "trainable_parameters": lora.trainable_parameters(module),
        "continued": inputs.parent_adapter is not None,
        "base": {"uri": inputs.model.uri, "digest": base_digest(inputs.model.files)},
    }


def publish(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    inputs: Inputs,
    dropout: dict[str, float],
    doc: TrainResult,
    state_dict: dict[str, torch.Tensor] | None,
    config: TrainConfig,
) -> None:
    """Rank 0: the Hugging Face checkpoint, the parent's tokenizer files and train.json,
    files 0644, committed with the manifest last."""
    out_dir = scratch / "publish"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    module = engine.module
    metadata = {
        "kind": "checkpoint",
        "producedBy": "rtrl-job train",
        "parent": config.parent,
        "data": config.data,
    }
    copied: list[str] = []
    if inputs.adapter is not None:
        # the adapter alone (ZeRO 0-2: rank 0 holds it whole), its lineage in the manifest
        lora.save(module, out_dir, base_uri=inputs.model.uri)
        metadata.update(
            kind=lora.KIND, base=inputs.model.uri, baseDigest=base_digest(inputs.model.files)
        )
    else:
        for name, value in dropout.items():
            setattr(module.config, name, value)
        # ZeRO 0-2: every rank holds the whole module. ZeRO-3: state_dict was gathered from
        # all ranks; save_pretrained drops tied duplicates (lm_head = embeddings) in both.
        module.save_pretrained(out_dir, state_dict=state_dict)
        copied = cio.copy_parent_files(inputs.parent, out_dir)
    (out_dir / TrainResult.FILE).write_text(doc.to_json(sort_keys=True))
    files = cio.checkpoint_files(out_dir)
    store.commit("", files, metadata)
    extra = f"; from the parent: {', '.join(copied)}" if copied else ""
    say(f"published {store.uri} ({len(files)} files{extra})")


def delete_leftover_state(store: ObjectStore) -> None:
    """Optimizer state is only for resuming; once the checkpoint is committed it is waste
    (three times the model's size)."""
    for step in cio.committed_steps(store):
        cio.delete_prefix(store, cio.step_prefix(step))
    for info in list(store.list(f"{cio.STATE_PREFIX}/")):
        store.delete(info.key)
