"""--compile and --activation-checkpointing: what each does to the decoder layers, in place.

    speed.apply_activation_checkpointing(model)  # recompute each layer's activations in backward
    speed.compile_layers(model)                  # torch.compile each layer, and the loss

lib/training.py's prepare_layers imports this file only when one of the two flags is given. Both
change how a layer runs, never its parameters or their names, so checkpoints and model.pt are
the same with them or without."""

import functools
import os
import shutil
import types

import torch
from torch.utils.checkpoint import checkpoint


def compile_layers(model: torch.nn.Module, loss: bool = True) -> None:
    """Compile each decoder layer's forward (one graph, reused; the names unchanged) and, with
    loss, model.loss too: the upcast of the logits and the log-softmax fused into one kernel (not
    for the vocabulary shards of TP, nor for PP, whose last stage computes the loss itself).
    Before apply_activation_checkpointing, which then recomputes the compiled forward: compiled
    inside the checkpoint, under TP's DTensors it fails (torch 2.13)."""
    # model.layers: the nn.ModuleList of a model, or the nn.ModuleDict of a pipeline stage;
    # children() reads either in order.
    for layer in model.layers.children():
        layer.__class__ = subclass(type(layer), "Compiled", "forward", compiled)
    if loss:
        model.__class__ = subclass(type(model), "CompiledLoss", "loss", compiled)


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute the activations of each decoder layer in backward instead of storing them. The
    non-reentrant torch.utils.checkpoint works with DDP, FSDP and compile alike."""
    for layer in model.layers.children():  # (either kind, as in compile_layers)
        layer.__class__ = subclass(type(layer), "Checkpointed", "forward", checkpointed)


# Why a subclass, and not `layer.forward = checkpoint(layer.forward)` or `layer.compile()`: both
# store on the instance a method bound to that instance, and nn.DataParallel's replicas copy the
# instance's attributes, so the replica on cuda:1 would run the original layer, with cuda:0's
# weights. A method of the class binds to whichever replica calls it. The instance keeps its
# parameters and their names (state_dict unchanged); fully_shard, applied after, subclasses
# again in the same way, and parallelize_module only adds hooks (which run outside the compiled
# forward).
@functools.cache
def subclass(cls: type, prefix: str, name: str, wrap) -> type:
    """cls with its method `name` replaced by wrap(cls.`name`): one class per (cls, wrapper)."""
    new = type(prefix + cls.__name__, (cls,), {name: wrap(getattr(cls, name))})
    new.__module__ = cls.__module__
    return new


def checkpointed(forward):
    """forward, run under the non-reentrant torch.utils.checkpoint."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        # Bound here, at the call, to the module (or replica) called: not stored anywhere. (The
        # module itself as an argument of checkpoint breaks under compile with TP's DTensors.)
        return checkpoint(types.MethodType(forward, self), *args, use_reentrant=False, **kwargs)

    return run


def compiled(method):
    """method compiled once for the class: each caller passes itself in as `self`, its
    parameters inputs of the one graph."""
    graph = torch.compile(method)

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return graph(self, *args, **kwargs)

    return run


def compiler_missing(device: torch.device) -> str | None:
    """Why --compile cannot run on `device`, or None: Inductor builds C++ for a CPU with $CXX."""
    if device.type == "cpu" and not shutil.which(cxx := os.environ.get("CXX", "g++")):
        return f"--compile on a CPU needs a C++ compiler ({cxx}): install one, set CXX or drop it"
    return None
