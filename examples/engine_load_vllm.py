"""Load a tpshard export with vLLM's own loader on a CPU, rank by rank, and compare it bit for bit
with vLLM's own load of the Hugging Face source (docs/deploy.md; shared ENGINE_FORMATS.md §9).

    python examples/engine_load_vllm.py MODEL EXPORT TP [RANKS]     # e.g. ... 8 0,3,7

Not part of the tests: it needs vLLM (0.33.0 was used) importable next to a CPU torch, e.g. a
virtualenv made with --system-site-packages and `pip install --no-deps vllm==0.33.0` plus the
pure-Python modules its imports ask for. Each rank builds the real model class twice in a
one-process gloo world whose TP rank and size are replaced by the case's, and loads it through
`get_model_loader(LoadConfig(load_format=...)).load_model` in full: "auto" from MODEL (vLLM's weight
loaders slice the HF tensors) and "sharded_state" from EXPORT. Exit 1 if any rank differs.
"""

from __future__ import annotations

import os
import socket
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402


def main(model: str, export: str, tp: int, ranks: list[int]) -> int:
    torch.accelerator.empty_cache = lambda: None  # raises without an accelerator; load_model calls it

    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", enforce_eager=True))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)

    case = {"rank": 0, "size": 1}

    def pose_as_rank() -> None:
        # The layers bound the TP getters at import: replace them wherever a vllm module holds one.
        for name, mod in list(sys.modules.items()):
            if name.startswith("vllm") and mod is not None:
                if hasattr(mod, "get_tensor_model_parallel_rank"):
                    mod.get_tensor_model_parallel_rank = lambda *a, **k: case["rank"]
                if hasattr(mod, "get_tensor_model_parallel_world_size"):
                    mod.get_tensor_model_parallel_world_size = lambda *a, **k: case["size"]

    def load(path: str, load_format: str) -> dict[str, torch.Tensor]:
        mc = ModelConfig(model=path, dtype="bfloat16", enforce_eager=True)
        vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format=load_format))
        with set_current_vllm_config(vc):
            pose_as_rank()
            m = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    failed = 0
    for r in ranks:
        case.update(rank=r, size=tp)
        ref = load(model, "auto")
        try:
            got = load(export, "sharded_state")
        except Exception as e:  # what the engine says about a broken export is the result here
            print(f"tp {tp} rank {r}: vLLM refused the export: {type(e).__name__}: {str(e)[:200]}")
            failed += 1
            continue
        diff = sorted(k for k in ref.keys() | got.keys() if k not in ref or k not in got or not same(ref[k], got[k]))
        print(f"tp {tp} rank {r}: {len(ref)} state_dict entries, " + ("bit-equal" if not diff else f"DIFFER: {diff[:4]}"))
        failed += bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    model, export, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ranks = [int(r) for r in sys.argv[4].split(",")] if len(sys.argv) > 4 else list(range(tp))
    sys.exit(main(model, export, tp, ranks))
