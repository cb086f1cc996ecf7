"""Lets the index's torchvision (a CUDA build) be imported beside the CPU torch in the SGLang env.

SGLang imports torchvision unconditionally. That build's ``_C.so`` cannot load beside CPU torch,
so its ops are never defined, and ``torchvision/_meta_registrations.py`` then fails on import
("operator torchvision::nms does not exist"). Defining the two op schemas it registers fake
kernels for, just before torchvision is first imported, is enough: nothing in SGLang's CPU path
calls them. Installed by ``setup-sglang-cpu.sh`` as a ``.pth`` hook (so SGLang's spawned
scheduler processes get it too); it costs nothing until torchvision is imported.
"""

import importlib.abc
import sys

_LIBS = []  # a torch.library.Library must stay alive for its definitions to stay


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            if torch.version.cuda is None:
                lib = torch.library.Library("torchvision", "DEF")
                lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _LIBS.append(lib)
        return None  # the ordinary finders import it


if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
