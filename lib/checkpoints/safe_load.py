"""Loading a DCP checkpoint without running code from its directory (imported only to load one:
sharded.py's resume and the end of a run).

dcp.load unpickles two things that a crafted checkpoint could turn into code run on resume:
  - the `.metadata` file (which file holds which piece of which tensor): DCP's FileSystemReader
    reads it with plain pickle.load, which calls whatever function the file names;
  - every value that is not a tensor (here AdamW's per-parameter lr, betas, weight decay, ...):
    DCP's DefaultLoadPlanner reads it with torch.load(weights_only=False), the same.
safe_load_options(path) gives dcp.load the reader and planner that close both (safe_load calls
it so). `.metadata` goes through an Unpickler that resolves only the classes DCP's metadata is
built from (METADATA_GLOBALS: every global that the .metadata files of these scripts name) and
refuses any other; values go through torch.load(weights_only=True), plain data only. Tensors DCP
already reads that way.
"""

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "WindowsPath")
    ),
}


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves METADATA_GLOBALS and torch dtypes, and nothing else.

    A pickle can only run code through the globals it names (a function or class to call), so
    refusing every other name, before its module is even imported, leaves it nothing to run.
    """

    def find_class(self, module: str, name: str):
        # vars(), not getattr(): torch's module __getattr__ would import whatever it is asked for.
        is_dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused to unpickle {module}.{name}: it is not one of DCP's metadata types"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose read_metadata unpickles only DCP's metadata types.

    The rest (reading the tensors, storage_data, resharding) is FileSystemReader's. Unlike its
    read_metadata, this one takes no rank: DCP then never falls back to per-rank
    `__<rank>.metadata` files, which these scripts do not write. It reads `.metadata` once, and
    hands every later dcp.load through it the same (the end of a run loads one tensor at a time:
    on many ranks `.metadata` maps every piece of every tensor, and is large).
    """

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata = None  # read_metadata's, once read

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = self._read_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # (this load's, as DCP's reader sets)
        return self._metadata

    def _read_metadata(self) -> Metadata:
        path = os.path.join(self.path, ".metadata")  # DCP's file name for it
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except Exception as e:  # refused, truncated, missing: all mean "cannot load this"
            raise ValueError(f"cannot read {path}: {e}") from e
        if not isinstance(metadata, Metadata):
            raise ValueError(f"cannot read {path}: it holds a {type(metadata).__name__}")
        # What FileSystemReader.read_metadata does after unpickling, kept as it is.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads the values that are not tensors with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)  # numbers, strings, tuples, tensors
        except Exception as e:
            raise ValueError(f"refused to unpickle the value of {fqn}: not plain data") from e
        # DefaultLoadPlanner.load_bytes puts the value where it belongs in the nested state
        # dict, but unpickles it with weights_only=False: hand it a copy written from the plain
        # object just read, which holds nothing but what weights_only=True allowed.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def safe_load_options(path: str) -> dict:
    """dcp.load's keyword arguments that make it run no code from `path`:
    dcp.load(state_dict, **safe_load_options(path)). ValueError (naming the file) for a .metadata it
    refuses, here and now; a refused value fails dcp.load itself."""
    reader = SafeFileSystemReader(path)
    # Read once here first: a refused .metadata then ends in the ValueError above. Inside
    # dcp.load the same failure is logged with a traceback, then reported as "metadata is None".
    reader.read_metadata()
    return {"storage_reader": reader, "planner": SafeLoadPlanner()}


def safe_load(state_dict: dict, path: str, no_dist: bool = False) -> None:
    """dcp.load(state_dict, checkpoint_id=path, no_dist=no_dist) that runs no code from path."""
    dcp.load(state_dict, **safe_load_options(path), no_dist=no_dist)
