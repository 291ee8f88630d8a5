"""TEST-ONLY shim, activated by putting this folder on PYTHONPATH (tests/conftest.py does it for subprocesses too).

The CPU test machines have no CPU build of torchvision. transformers' Qwen2-VL image processor module imports it at
the top, and vLLM's Qwen2.5-VL model imports that module, so neither can load a Qwen2.5-VL there. This serves
transformers' own PIL image processor under the torchvision module's name, and a video-processor module whose class
refuses to be used (our tests send no video). Product code never imports this; machines with torchvision never
need it. See ../shared/NOTES-cpu-stack.md.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_VIDEO = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == _IMAGE:
            pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
            module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
            module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
            module.Qwen2VLImageProcessorFast = pil.Qwen2VLImageProcessorPil
        else:
            from transformers.video_processing_utils import BaseVideoProcessor

            class Qwen2VLVideoProcessor(BaseVideoProcessor):
                def __init__(self, *a, **k):
                    raise RuntimeError("video is not available in the CPU test shim")
            module.Qwen2VLVideoProcessor = Qwen2VLVideoProcessor


_PROCESSOR = "transformers.models.qwen2_5_vl.processing_qwen2_5_vl"


class _NoVideo:
    """Stands where the video processor would be: vLLM reads its kwargs; any use raises."""
    class valid_kwargs:  # noqa: N801 - mirrors the attribute vLLM reads
        __annotations__ = {}

    def __call__(self, *a, **k):
        raise RuntimeError("video is not available in the CPU test shim")


def _drop_video(module):
    """Give Qwen2_5_VLProcessor an __init__ without a video_processor (transformers builds sub-processors from it)."""
    cls = module.Qwen2_5_VLProcessor
    original = cls.__init__

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        original(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = _NoVideo()
    cls.__init__ = __init__


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, real, patch):
        self.real, self.patch = real, patch

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in (_IMAGE, _VIDEO):
            return importlib.util.spec_from_loader(name, _Loader())
        if name == _PROCESSOR:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = _PatchAfterExec(spec.loader, _drop_video)
            return spec
        return None


try:
    import torchvision  # noqa: F401
except ImportError:
    sys.meta_path.insert(0, _Finder())
