"""kiln compiles for inference: a model left in train mode is refused where that mode
changes what it computes (active dropout, batch statistics), unless the user opts in.

Checked on the modules, before export, so the error names the module a user can call
`.eval()` on; a module in train mode that computes the same either way passes.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.errors import ArgumentError

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def train_mode_differences(model: nn.Module) -> list[str]:
    """'name (what train mode changes)' for each submodule whose training flag matters."""
    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        label = name or "the model"
        if isinstance(m, nn.modules.dropout._DropoutNd | nn.AlphaDropout) and m.p > 0:
            found.append(f"{label} ({type(m).__name__} p={m.p} is active)")
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) or (
                isinstance(m, _NORMS) and m.track_running_stats):
            found.append(f"{label} ({type(m).__name__} uses batch statistics)")
        elif isinstance(m, nn.RNNBase | nn.MultiheadAttention) and m.dropout > 0:
            found.append(f"{label} ({type(m).__name__} dropout={m.dropout} is active)")
    return found


def check_inference_mode(model: nn.Module, allow_train: bool) -> None:
    if allow_train or not isinstance(model, torch.nn.Module):
        return
    found = train_mode_differences(model)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ArgumentError(
            "the model is in train mode, where it computes something else than in eval "
            f"mode: {'; '.join(found[:3])}{more}",
            where=found[0].partition(" (")[0],
            hint="call model.eval() before kiln.compile (kiln compiles for inference; its "
            "outputs carry no autograd), or pass allow_train=True to compile the "
            "train-mode behaviour as it is")
