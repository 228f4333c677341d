"""Imported by Python at start-up in the SGLang server a rollout server launches on a CPU (this
directory is on its PYTHONPATH): declares torchvision's ``nms`` and ``qnms`` operator schemas.

PyPI's torchvision is a CUDA build; beside the CPU torch its operator library does not load,
and ``import torchvision`` then fails in ``torchvision._meta_registrations``, which registers
fake kernels for those two operators without checking that they exist. SGLang imports
torchvision (for image models) whenever it starts. With the schemas declared the import
succeeds; calling either operator still fails, and no text model calls them.
"""

from __future__ import annotations

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _declare() -> object | None:
    try:
        import torch
    except ImportError:  # not SGLang's venv: nothing to declare for
        return None
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
    return library


# Kept alive: the declarations last as long as the library object.
_TORCHVISION_SCHEMAS = _declare()
