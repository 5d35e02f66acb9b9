"""examples/engine_load_vllm.py for the MoE families on a CPU: vLLM's own load of MODEL ("auto") and
of EXPORT ("sharded_state"), every state_dict() entry compared bit for bit, rank by rank, with
post-processing off on both sides (vLLM's CPU MoE post-processing needs its C ops; the files hold
the pre-processing layout). docs/deploy.md lists what was loaded so.

    python examples/engine_load_vllm_moe.py MODEL EXPORT TP [RANKS]

Llama-4 is built with `language_model_only=True` (`vllm serve --language-model-only`: its export
holds no vision tower). Two stand-ins, no weight loader touched: gpt-oss's unquantized MoE backend choice (vLLM's CPU
backends refuse its activation when the layer is built; the model is only loaded, never run), and
an empty `torchvision` package for Qwen3.5-MoE (models/qwen3_5.py imports the Qwen3-VL image
processor, which imports torchvision; so does Llama-4's mllama4.py), put on PYTHONPATH so that vLLM's model-inspection
subprocess sees it too. Exit 1 if any rank differs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

STUB = '''__version__ = "0.27.0"


class _Meta(type):
    def __getattr__(cls, a):
        if a.startswith("__"):
            raise AttributeError(a)
        return Any


Any = _Meta("Any", (), {})


def __getattr__(a):
    if a.startswith("__"):
        raise AttributeError(a)
    return Any
'''


def stub_torchvision() -> None:
    """An importable torchvision whose every attribute is a dummy class (never called here)."""
    try:
        import torchvision  # noqa: F401

        return
    except ImportError:
        pass
    root = tempfile.mkdtemp(prefix="tv-stub-")
    for mod in ("torchvision", "torchvision/transforms", "torchvision/transforms/v2"):
        os.makedirs(os.path.join(root, mod), exist_ok=True)
        with open(os.path.join(root, mod, "__init__.py"), "w") as f:
            f.write(STUB)
    for mod in ("torchvision/transforms/v2/functional", "torchvision/transforms/functional", "torchvision/io", "torchvision/ops"):
        with open(os.path.join(root, mod + ".py"), "w") as f:
            f.write(STUB)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def stand_in_moe_backend() -> None:
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    method.select_unquantized_moe_backend = lambda **kwargs: (UnquantizedMoeBackend.TRITON, None)


def main(model: str, export: str, tp: int, ranks: list[int]) -> int:
    model_type = json.loads(open(os.path.join(model, "config.json")).read()).get("model_type", "")
    if model_type.startswith("qwen3_5") or model_type == "llama4":  # llama4: transformers' image processor
        stub_torchvision()
    from engine_compare import compare_ranks
    from engine_load_vllm import vllm_loader

    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    if model_type == "gpt_oss":
        stand_in_moe_backend()
    ep = json.loads(open(os.path.join(export, "tpshard-export.json")).read())["from"]["topology"].get("ep", 1) > 1
    # Llama-4: the export holds the language model only, served with --language-model-only (docs/deploy.md)
    options = {"language_model_only": True} if model_type == "llama4" else {}
    build = vllm_loader(model, expert_parallel=ep, post_process=False, model_options=options)

    def load(r: int, path: str, load_format: str) -> dict:
        state = ShardedStateLoader._filter_subtensors(build(r, tp, path, load_format).state_dict())
        return {k: v.detach().clone() for k, v in state.items()}

    return compare_ranks("vLLM", model, export, tp, ranks, load)


if __name__ == "__main__":
    from engine_compare import args

    sys.exit(main(*args()))
