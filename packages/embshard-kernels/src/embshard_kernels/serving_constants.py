"""A serving package's constants (weights) as raw records, mapped from the package file.

AOTInductor either keeps a package's constants inside its compiled library or in one blob its
loader reads whole before copying every constant out of it, so loading peaks at twice the
weights. :func:`repack_constants` rewrites a package compiled with
``package_constants_on_disk_format="pickle_weights"``: each constant's storage becomes one raw
record of the archive (uncompressed, 64-byte aligned), listed in :data:`MANIFEST`, one line per
constant::

    name <TAB> record <TAB> dtype <TAB> device type <TAB> sizes <TAB> strides <TAB> storage offset

(``dtype`` as ``torch.<dtype>`` spells it, without the prefix; sizes and strides
comma-separated). :func:`map_constants` maps the package file once (a private mapping nothing
writes to: pages come from the page cache as they are touched, nothing is copied) and views
every constant in it; the runner is given them as user-managed constants, so the caller keeps the
returned tensors alive as long as the runner. ``cpp/serve_package.cpp`` reads the same manifest.
A package is replaced by renaming a new file over it (``package_for_serving`` does): rewriting
the file in place would change the weights under a process serving it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import cast

import torch
from torch import Tensor
from torch.export.pt2_archive import PT2ArchiveReader, PT2ArchiveWriter

__all__ = ["MANIFEST", "map_constants", "repack_constants"]

MANIFEST = "data/embshard/constants.tsv"
"""Archive record listing the package's constants (see the module docstring)."""

_RECORDS = "data/embshard/constants/"
_PICKLED = "data/weights/"
_WRITER_OWN = frozenset({".data/version", ".data/serialization_id", "byteorder"})
"""Records ``PyTorchFileWriter`` writes into every archive itself."""


def repack_constants(source: Path, target: Path) -> None:
    """Write ``target``: the package ``source`` with its pickled constants as raw records."""
    with PT2ArchiveReader(str(source)) as reader, PT2ArchiveWriter(str(target)) as writer:
        names = reader.get_file_names()
        configs = [n for n in names if n.endswith("/weights_config.json")]
        if len(configs) > 1:
            raise ValueError(f"repack_constants: {source} holds {len(configs)} models, not 1")
        for name in names:
            if name in _WRITER_OWN or name in configs or name.startswith(_PICKLED):
                continue
            writer.write_bytes(name, reader.read_bytes(name))
        if not configs:
            return  # no constants beside the code: the loader needs none from us
        config: dict[str, list] = json.loads(reader.read_string(configs[0]))
        lines, kinds = [], {}  # kinds: each written record's dtype and device type
        for name, (record, sizes, strides, offset) in config.items():
            if record not in kinds:
                tensor = torch.load(io.BytesIO(reader.read_bytes(_PICKLED + record)))
                # written from the storage's memory, as torch.save does
                storage = tensor.untyped_storage().cpu()
                writer.archive_file.write_record(_RECORDS + record, storage, storage.nbytes())
                kinds[record] = (str(tensor.dtype).removeprefix("torch."), tensor.device.type)
            dtype, device_type = kinds[record]
            fields = (
                name,
                record,
                dtype,
                device_type,
                ",".join(map(str, sizes)),
                ",".join(map(str, strides)),
                str(offset),
            )
            lines.append("\t".join(fields))
        writer.write_string(MANIFEST, "".join(f"{line}\n" for line in lines))


def map_constants(path: Path) -> dict[str, Tensor] | None:
    """Every constant of the package ``path`` viewed in one mapping of the file (copied to its
    accelerator where its record says it lives on one), or ``None`` for a package without a
    :data:`MANIFEST` (its loader loads the constants itself)."""
    with PT2ArchiveReader(str(path)) as reader:
        if MANIFEST not in reader.get_file_names():
            return None
        size = os.path.getsize(path)
        file = torch.UntypedStorage.from_file(str(path), False, size)
        storage = cast(torch.UntypedStorage, file)
        offset_of = reader.archive_file.get_record_offset  # type: ignore[attr-defined]
        constants = {}
        for line in reader.read_string(MANIFEST).splitlines():
            name, record, dtype_name, device_type, sizes, strides, offset = line.split("\t")
            dtype = getattr(torch, dtype_name)
            start = offset_of(_RECORDS + record)
            if start % dtype.itemsize:
                raise ValueError(f"map_constants: {name} in {path} is not aligned to its dtype")
            view = torch.empty(0, dtype=dtype).set_(
                storage,
                start // dtype.itemsize + int(offset),
                [int(s) for s in sizes.split(",") if s],
                [int(s) for s in strides.split(",") if s],
            )
            constants[name] = view if device_type == "cpu" else view.to(device_type)
    return constants
