"""Load a tpshard `--format sglang` export with SGLang 0.5.23's own loader on a CPU, rank by
rank, and compare it bit for bit with SGLang's own `auto` load of the HF source (docs/deploy.md;
docs/deploy.md).

    python examples/engine_load_sglang.py MODEL EXPORT TP [RANKS]

Not part of the tests: needs SGLang 0.5.23 importable next to a CPU torch (setup in docs/deploy.md).
Per rank: publish(ServerArgs(tp_size=TP, ...), SpawnRanks(world_rank=r)), rank/size-only stand-ins
stamped for every group handle of the ParallelContext, torchvision and vllm stubbed, then
get_model_loader(LoadConfig(load_format=...), model_config).load_model(...) in full: "auto" from
MODEL and "sharded_state" from EXPORT; every state_dict entry compared bit for bit. Exit 1 if any
rank differs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
from engine_compare import args, compare_ranks


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the given top-level packages with empty modules whose every name exists."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def install_stubs() -> None:
    # torchvision's C ops do not load next to this CPU torch; SGLang's multimodal config modules
    # (imported by sglang.srt.configs) only need its names. transformers must keep seeing none:
    # cache its answer before the stub is on the path.
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    # vllm._custom_ops: the forward-only rotary kernel import SGLang takes on platforms it does not
    # recognise (docs/deploy.md).
    sys.meta_path.insert(0, _StubFinder({"torchvision", "vllm"}))


class _Group:
    """Communication-free stand-in for a GroupCoordinator: rank and size only."""

    is_first_rank = is_last_rank = True

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group, self.world_size, self.rank = rank, size, rank
        self.ranks = list(range(size))
        self.local_rank = 0
        self.device_group = self.cpu_group = None


def main(model: str, export: str, tp: int, ranks: list[int]) -> int:
    install_stubs()
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def load(r: int, path: str, load_format: str) -> dict[str, torch.Tensor]:
        reset_context()
        publish(ServerArgs(model_path=path, tp_size=tp, device="cpu", dtype="bfloat16", load_format=load_format), role="test", ranks=SpawnRanks(world_rank=r))
        par = get_parallel()
        # Every group handle the context declares: the TP-wide ones pose as rank r of tp (tp, attn_tp,
        # moe_tp without attention DP or EP), the others as a group of one.
        from sglang.srt.runtime_context import _derived_widths

        for name in _derived_widths():
            if name.endswith("_group"):
                par._stamp[name] = _Group(r, tp) if name in ("tp_group", "attn_tp_group", "moe_tp_group") else _Group(0, 1)  # ParallelContext reads its permanent stamp before the published config
        mc = ModelConfig(model_path=path, dtype="bfloat16")
        loader = get_model_loader(LoadConfig(load_format=load_format), mc)
        m = loader.load_model(model_config=mc, device_config=DeviceConfig("cpu"))
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    return compare_ranks("SGLang", model, export, tp, ranks, load)


if __name__ == "__main__":
    sys.exit(main(*args()))
