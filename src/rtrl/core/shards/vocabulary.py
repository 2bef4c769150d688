"""The vocabulary that bounds the shards' token ids: a checkpoint's ``config.json``
``vocab_size``, read through the object store.

A token id at or beyond the vocabulary of the model that will be trained cannot be embedded,
so the validating reader quarantines it (``token_out_of_range``). The bound has to be the
vocabulary of the checkpoint the rows will train, the serving one (the next one's parent),
and it has to be read the same way wherever it is used: by ``rtrl shards validate
--checkpoint``, by the stage step (``--parent``) and by the train step, which checks the
same ids again against the same parent. This is that one reader. It parses the JSON itself,
without transformers: the operator image, where ``rtrl shards validate`` runs, has no
transformers, and importing it would add seconds to every stage run.

The rule is transformers' ``PretrainedConfig.get_text_config()``: a composite model (an
image-text model, an encoder-decoder) keeps its text part under one of a few names; when
exactly one is there its ``vocab_size`` counts, else the top level's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rtrl.core.store.base import ObjectNotFound, ObjectStore

CONFIG_NAME = "config.json"
# get_text_config()'s names of a composite model's text part, in its order.
TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")


class VocabularyError(ValueError):
    """The checkpoint's config gives no usable vocabulary; the message says why (the
    caller names the checkpoint)."""


def vocab_size_of(config: Mapping[str, Any]) -> int:
    """The vocabulary size of a parsed ``config.json`` (see the module's rule)."""
    parts = [name for name in TEXT_CONFIG_NAMES if isinstance(config.get(name), Mapping)]
    if len(parts) > 1:
        raise VocabularyError(
            f"{CONFIG_NAME}: which text config holds the vocabulary is ambiguous: "
            + ", ".join(parts)
        )
    where, section = (parts[0], config[parts[0]]) if parts else ("", config)
    if "vocab_size" not in section:
        inside = f" {where}" if where else ""
        raise VocabularyError(f"{CONFIG_NAME}{inside} has no vocab_size")
    size = section["vocab_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise VocabularyError(f"{CONFIG_NAME}: vocab_size must be a positive integer, got {size!r}")
    return size


def parse_config(data: bytes) -> Mapping[str, Any]:
    """``config.json``'s bytes as a mapping; :class:`VocabularyError` when they are not a
    JSON object."""
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise VocabularyError(f"{CONFIG_NAME} is not JSON") from None
    if not isinstance(config, dict):
        raise VocabularyError(f"{CONFIG_NAME} is not a JSON object")
    return config


def read_vocab_size(store: ObjectStore) -> int:
    """The vocabulary of the checkpoint at ``store``'s root (its ``config.json`` only is
    read, checked against the checkpoint's manifest when it has one, as every input of a
    step is). A :class:`~rtrl.core.store.StoreError` means the store failed;
    :class:`VocabularyError` that the checkpoint has no usable config."""
    manifest = store.committed("")
    try:
        data = store.get_bytes(CONFIG_NAME)
    except ObjectNotFound:
        raise VocabularyError(
            f"no {CONFIG_NAME} (not a Hugging Face checkpoint: {store.url(CONFIG_NAME)})"
        ) from None
    entry = manifest.files.get(CONFIG_NAME) if manifest is not None else None
    if entry is not None and entry.get("sha256") not in (None, hashlib.sha256(data).hexdigest()):
        raise VocabularyError(f"{CONFIG_NAME} does not match its manifest (sha256)")
    return vocab_size_of(parse_config(data))
