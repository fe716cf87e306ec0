"""--compile and --activation-checkpointing: what each does to the decoder layers, in place.

    speed.apply_activation_checkpointing(model)  # recompute each layer's activations in backward
    speed.compile_layers(model)                  # torch.compile each layer, and the loss

lib/training.py's prepare_layers imports this file only when one of the two flags is given. Both
change how a layer runs, never its parameters or their names, so checkpoints and model.pt are
the same with them or without."""

import functools
import os
import shutil

import torch
from torch.utils.checkpoint import checkpoint


def compile_layers(model: torch.nn.Module, loss: bool = True) -> None:
    """Compile each decoder layer in place (one graph, reused; the names unchanged) and, with
    loss, model.loss too: the upcast of the logits and the log-softmax fused into one kernel (not
    for the vocabulary shards of TP, nor for PP, whose last stage computes the loss itself)."""
    # model.layers: the nn.ModuleList of a model, or the nn.ModuleDict of a pipeline stage;
    # children() reads either in order.
    for layer in model.layers.children():
        layer.compile()
    if loss:
        model.loss = torch.compile(model.loss)


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute the activations of each decoder layer in backward instead of storing them. The
    non-reentrant torch.utils.checkpoint works with DDP, FSDP and compile alike."""
    for layer in model.layers.children():  # (either kind, as in compile_layers)
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def compiler_missing(device: torch.device) -> str | None:
    """Why --compile cannot run on `device`, or None: Inductor builds C++ for a CPU with $CXX."""
    if device.type == "cpu" and not shutil.which(cxx := os.environ.get("CXX", "g++")):
        return f"--compile on a CPU needs a C++ compiler ({cxx}): install one, set CXX or drop it"
    return None
