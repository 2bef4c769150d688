"""Loading the parent straight into ZeRO-3 partitions, in the training precision.

With ZeRO-3 each of W ranks keeps 1/W of the weights, but ``from_pretrained`` first builds
the whole model on every rank: 4 bytes x parameters per rank (32 GB for an 8B model, times
the ranks of a node) before ``deepspeed.initialize`` partitions it. Here the model is built
under ``deepspeed.zero.Init``, which partitions every parameter as soon as its layer is
constructed (weight initialisation skipped: the parent's values replace it), in the
training dtype; the parent's safetensors are then read one tensor at a time: the tensor is
gathered, rank 0 copies the file's values into it, and DeepSpeed broadcasts and partitions
it again. The most any rank holds beyond its partitions is one whole tensor.

Only rank 0 reads tensor data; every rank reads the files' headers (names and shapes), so
a parent that does not fit the model is refused on all ranks alike, before any collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rtrl_trainer.train.collectives import TrainAbortError


def tensor_index(parent_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of the parent's safetensors files: name -> (file, shape)."""
    from safetensors import safe_open

    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in sorted(parent_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                index[key] = (path, tuple(handle.get_slice(key).get_shape()))
    return index


def load_partitioned(
    parent_dir: Path, hf_config: Any, ds_config: dict[str, Any], dtype: torch.dtype
) -> Any:
    """The parent as a ZeRO-3-partitioned model of ``dtype`` (see the module docstring)."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    index = tensor_index(parent_dir)
    if not index:
        raise TrainAbortError(f"parent {parent_dir}: no *.safetensors weights to load")
    # zero.Init replaces torch.Tensor.__new__, and torch._dynamo checks that signature when
    # it is first imported (TypeError: Signature mismatch ... tensor_pynew); transformers
    # imports it lazily with the model's module, so the caller has imported both
    # (engine.import_model_code).
    # prevent_arange_dtype_change: RoPE tables built with torch.arange keep their dtype
    # (zero.Init would build them in bf16), as transformers' own ZeRO-3 path does.
    # zero.Init takes its dtype from the config's bf16 section: its ``dtype`` argument is
    # ignored where the accelerator has no fp16 (DeepSpeed 0.19.8 on CPU makes it bf16).
    with (
        no_init_weights(),
        prevent_arange_dtype_change(),
        deepspeed.zero.Init(config_dict_or_path=ds_config),
    ):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.tie_weights()
    wrong = {p.dtype for p in model.parameters()} - {dtype}
    if wrong:
        raise RuntimeError(f"zero.Init built parameters of {wrong}, expected {dtype}")
    fill_from_safetensors(model, index, parent_dir)
    return model


def fill_from_safetensors(
    model: Any, index: dict[str, tuple[Path, tuple[int, ...]]], parent_dir: Path
) -> None:
    """Copy the parent's tensors into the partitioned ``model``, one gathered tensor at a
    time; a parameter missing from the files, or of another shape, stops the run."""
    import deepspeed
    from safetensors import safe_open

    prefix = getattr(model, "base_model_prefix", "")
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    plan: list[tuple[torch.nn.Parameter, str]] = []
    for name, param in model.named_parameters():
        key = _find(names[id(param)], index, prefix)
        if key is None:
            raise TrainAbortError(f"parent {parent_dir}: no tensor {name} in its safetensors")
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if index[key][1] != shape:
            raise TrainAbortError(
                f"parent {parent_dir}: tensor {key} has shape {list(index[key][1])}, "
                f"the model's {name} {list(shape)}"
            )
        plan.append((param, key))
    rank = dist.get_rank()

    def read(key: str) -> torch.Tensor:
        # Opened for each tensor: the file is memory-mapped while open, and every page read
        # through the mapping counts in this process's resident set until it is closed.
        with safe_open(str(index[key][0]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(key)
        return tensor

    with torch.no_grad():
        for param, key in plan:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.data.copy_(read(key))
        # Buffers are whole on every rank (ZeRO-3 partitions parameters only): each rank
        # copies the ones the parent stores.
        for name, buffer in model.named_buffers():
            key = _find([name], index, prefix)
            if key is not None and index[key][1] == tuple(buffer.shape):
                buffer.copy_(read(key))


def _find(
    names: list[str], index: dict[str, tuple[Path, tuple[int, ...]]], prefix: str
) -> str | None:
    """The checkpoint's key for a parameter known by ``names`` (tied weights have several),
    with or without the model's base prefix (``transformer.``, ``model.``)."""
    for name in names:
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1 :])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        for candidate in candidates:
            if candidate in index:
                return candidate
    return None
