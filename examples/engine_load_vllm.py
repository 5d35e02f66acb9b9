"""Load a tpshard export with vLLM's own loader on a CPU, rank by rank, and compare it bit for bit
with vLLM's own load of the Hugging Face source (docs/deploy.md).

    python examples/engine_load_vllm.py MODEL EXPORT TP [RANKS]     # e.g. ... 8 0,3,7

Not part of the tests: it needs vLLM (0.33.0 was used) importable next to a CPU torch, e.g. a
virtualenv made with --system-site-packages and `pip install --no-deps vllm==0.33.0` plus the
pure-Python modules its imports ask for. Each rank builds the real model class twice in a
one-process gloo world whose TP rank and size are replaced by the case's, and loads it through
`get_model_loader(LoadConfig(load_format=...)).load_model` in full: "auto" from MODEL (vLLM's weight
loaders slice the HF tensors) and "sharded_state" from EXPORT. Exit 1 if any rank differs.
"""

from __future__ import annotations

import json
import os
import socket
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from engine_compare import args, compare_ranks  # noqa: E402


def vllm_loader(model: str, *, expert_parallel: bool = False, post_process: bool = True, model_options: dict | None = None, **load_options):
    """Set vLLM up on a CPU in a one-process gloo world; return build(rank, size, path, load_format)
    -> vLLM's model class for that TP rank, loaded in full by its own loader. `load_options` go to
    vLLM's LoadConfig as they are (e.g. safetensors_load_strategy="prefetch"), `model_options` to its
    ModelConfig (e.g. language_model_only=True, `vllm serve --language-model-only`)."""
    model_options = model_options or {}
    torch.accelerator.empty_cache = lambda: None  # raises without an accelerator; load_model calls it

    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", enforce_eager=True, **model_options))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    if not post_process:  # vLLM's CPU MoE post-processing needs its C ops; the files hold the pre-processing layout
        import vllm.model_executor.model_loader.base_loader as base_loader

        base_loader.process_weights_after_loading = lambda *a, **k: None

    case = {"rank": 0, "size": 1}

    def pose_as_rank() -> None:
        # The layers bound the TP getters at import: replace them wherever a vllm module holds one.
        for name, mod in list(sys.modules.items()):
            if name.startswith("vllm") and mod is not None:
                if hasattr(mod, "get_tensor_model_parallel_rank"):
                    mod.get_tensor_model_parallel_rank = lambda *a, **k: case["rank"]
                if hasattr(mod, "get_tensor_model_parallel_world_size"):
                    mod.get_tensor_model_parallel_world_size = lambda *a, **k: case["size"]
                # With --enable-expert-parallel the EP group is the TP group (dp 1): the model classes
                # that slice experts themselves (models/gpt_oss.py load_weights) read its rank and size;
                # imported when the model is built, they bind it from vllm.distributed then.
                if expert_parallel and (name.startswith("vllm.model_executor.models.") or name in ("vllm.distributed", "vllm.distributed.parallel_state")) and hasattr(mod, "get_ep_group"):
                    mod.get_ep_group = lambda *a, **k: _PosedGroup(case["rank"], case["size"])

    def build(rank: int, size: int, path: str, load_format: str):
        case.update(rank=rank, size=size)
        mc = ModelConfig(model=path, dtype="bfloat16", enforce_eager=True, **model_options)
        vc = VllmConfig(
            model_config=mc, load_config=LoadConfig(load_format=load_format, **load_options),
            parallel_config=ParallelConfig(enable_expert_parallel=expert_parallel),
        )  # fmt: skip
        with set_current_vllm_config(vc):
            pose_as_rank()
            return get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)

    return build


class _PosedGroup:
    """An EP group handle that answers rank and size only (the model is built and loaded, never run)."""

    def __init__(self, rank: int, size: int):
        self.rank_in_group, self.world_size = rank, size
        self.device_group = self

    def size(self) -> int:
        return self.world_size

    def rank(self) -> int:
        return self.rank_in_group


class _NoKernel:
    """Stands in for a quantized linear kernel vLLM cannot select on this CPU (FP8 block asks for
    AMX, NVFP4 has no CPU kernel list): it is only built, never run; post-processing is off."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None


def patch_kernel_selection() -> None:
    """Replace vLLM's quantized linear kernel choice (kernels/linear: choose_*_kernel returns a
    class, init_*_kernel an instance; Marlin's supported-type check) wherever a vllm module bound it. No weight loader is touched:
    create_weights and the loaders run as they are."""
    import vllm.model_executor.kernels.linear  # noqa: F401
    import vllm.model_executor.layers.quantization.auto_awq  # noqa: F401
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors  # noqa: F401
    import vllm.model_executor.layers.quantization.fp8  # noqa: F401
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4  # noqa: F401
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for attr in list(vars(mod)):
            if attr.endswith("_kernel") and attr.startswith("choose_") and callable(getattr(mod, attr)):
                setattr(mod, attr, lambda *a, **k: _NoKernel)
            elif attr.endswith("_linear_kernel") and attr.startswith("init_") and callable(getattr(mod, attr)):
                setattr(mod, attr, lambda *a, **k: _NoKernel())
            elif attr == "verify_marlin_supported":  # GPTQ 8-bit: Marlin's type list on this (CPU) device
                setattr(mod, attr, lambda *a, **k: None)
            elif attr.startswith("select_") and attr.endswith("_moe_backend") and callable(getattr(mod, attr)):
                setattr(mod, attr, _emulated_when_refused(getattr(mod, attr)))


def _emulated_when_refused(select):
    """A FusedMoE backend oracle (fused_moe/oracle/*.py select_*_moe_backend) that finds no CPU kernel
    for a quantized MoE (CT WNA16, NVFP4, GPTQ, AWQ) raises; answer its EMULATION backend and no
    experts class instead (kernel selection only: create_weights and the loaders run as they are)."""
    import enum

    if getattr(select, "emulated", False):
        return select
    found = [v for v in vars(sys.modules[select.__module__]).values() if isinstance(v, type) and issubclass(v, enum.Enum) and "EMULATION" in v.__members__]

    def choose(*args, **kwargs):
        try:
            return select(*args, **kwargs)
        except (NotImplementedError, ValueError, RuntimeError):
            if not found:
                raise
            return found[0].EMULATION, None

    choose.emulated = True
    return choose


def loader_for(model: str, *, expert_parallel: bool = False, **load_options):
    """vllm_loader for the checkpoint `model`: a quantized one (config.json's quantization_config)
    loads without post-processing and with the kernel selection replaced, since its files hold
    create_weights' layout and vLLM has no CPU kernel for most methods."""
    quantized = "quantization_config" in json.loads(open(os.path.join(model, "config.json")).read())
    build = vllm_loader(model, expert_parallel=expert_parallel, post_process=not quantized, **load_options)
    if quantized:
        patch_kernel_selection()
    return build


def main(model: str, export: str, tp: int, ranks: list[int]) -> int:
    # An export split with --ep = tp is served with --enable-expert-parallel (docs/deploy.md).
    ep = json.loads(open(os.path.join(export, "tpshard-export.json")).read())["from"]["topology"].get("ep", 1) > 1
    build = loader_for(model, expert_parallel=ep)

    def load(r: int, path: str, load_format: str) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in build(r, tp, path, load_format).state_dict().items()}

    return compare_ranks("vLLM", model, export, tp, ranks, load)


if __name__ == "__main__":
    sys.exit(main(*args()))
