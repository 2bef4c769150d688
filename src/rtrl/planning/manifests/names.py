"""What a cycle's objects are called, how they are labelled and owned, and where its files
sit in the store. Pure functions of the RLCycle and the Checkpoint, so that every reconcile
derives the same fixed names and "already exists" means "already done".

A cycle's artifacts sit under ``<storage.artifacts>cycles/<checkpoint>-<start time>/``:
``stage/`` (training set, stage.json), ``model/`` (the checkpoint, train.json, and the
Checkpoint's ``spec.uri``) and ``eval/`` (eval.json). The start time makes a retried cycle
number (after insufficient data) write to fresh locations, never onto an earlier attempt.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rtrl.core.api.names import API_VERSION, LABEL_CHECKPOINT, LABEL_RLCYCLE, MANAGED_BY
from rtrl.core.api.rlcycle import RLCycleSpec

STEPS = ("stage", "train", "eval")
RESULT_FILES = {"stage": "stage.json", "train": "train.json", "eval": "eval.json"}


# --- object names --------------------------------------------------------------------------
def checkpoint_name(rlcycle: str, cycle: int) -> str:
    return f"{rlcycle}-{cycle}"


def job_name(checkpoint: str, step: str, attempt: int) -> str:
    return f"{checkpoint}-{step}-{attempt}"


def config_map_name(checkpoint: str) -> str:
    return f"{checkpoint}-config"


def service_name(checkpoint: str) -> str:
    return f"{checkpoint}-train"


def canary_name(deployment: str) -> str:
    return f"{deployment}-canary"


def canary_service_name(service: str) -> str:
    return f"{service}-canary"


# --- store locations -----------------------------------------------------------------------
def model_uri(spec: RLCycleSpec, checkpoint: str, started: datetime) -> str:
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    base = (
        spec.storage.artifacts
        if spec.storage.artifacts.endswith("/")
        else f"{spec.storage.artifacts}/"
    )
    return f"{base}cycles/{checkpoint}-{stamp}/model/"


def run_prefix(checkpoint_uri: str) -> str:
    """The cycle's prefix, from its Checkpoint's ``spec.uri`` (``.../model/``)."""
    return checkpoint_uri.rstrip("/").removesuffix("/model") + "/"


def step_out(checkpoint_uri: str, step: str) -> str:
    return checkpoint_uri if step == "train" else f"{run_prefix(checkpoint_uri)}{step}/"


def result_name(step: str) -> str:
    """The result document of a step; ``analyze-<k>`` is the k-th canary analysis."""
    return "analysis.json" if step.startswith("analyze") else RESULT_FILES[step]


def result_uri(checkpoint_uri: str, step: str) -> str:
    return f"{step_out(checkpoint_uri, step)}{result_name(step)}"


def same_uri(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and a.rstrip("/") == b.rstrip("/")


# --- labels and owners ---------------------------------------------------------------------
def owner(kind: str, name: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def labels(rlcycle: str, checkpoint: str | None = None, **extra: str) -> dict[str, str]:
    out = {**MANAGED_BY, LABEL_RLCYCLE: rlcycle}
    if checkpoint is not None:
        out[LABEL_CHECKPOINT] = checkpoint
    out.update(extra)
    return out
