"""Load a pipeline-stage tpshard export (`split --engine vllm --pp P`, `export --format vllm`) with
vLLM's own loader on a CPU, stage by stage and rank by rank, and compare it bit for bit with vLLM's
own load of the Hugging Face source for the same stage (docs/pipeline.md).

    python examples/engine_load_vllm_pp.py MODEL EXPORT TP PP PARTITION [ep]  # e.g. ... 2 3 2,3,2

`ep`: the split used --ep TP (vLLM's --enable-expert-parallel); MoE post-processing is skipped then,
as in examples/engine_keys_vllm.py (vLLM's CPU MoE kernels need its C ops; the files hold the
pre-processing layout).

Not part of the tests; set up as examples/engine_load_vllm.py. Each world rank builds vLLM's real
model class in a one-process gloo world posing as that (pp_rank, tp_rank): the TP getters and the
pipeline group (`get_pp_group`: rank_in_group, world_size, is_first_rank, is_last_rank) are
replaced in every vllm module that bound them, so make_layers builds only the stage's layers and
the other pieces are PPMissingLayer, and the sharded_state loader renders
model-pp-{pp_rank}-tp-{tp_rank}-part-*. VLLM_PP_LAYER_PARTITION is set to PARTITION before vLLM is
imported. "auto" from MODEL is the reference (vLLM's load_weights skips other stages' tensors);
"sharded_state" from EXPORT must give the same state dict, and its loader raises on any key the
stage does not build (KeyError) or lacks (Missing keys). Exit 1 if any rank differs or is refused.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_PP_LAYER_PARTITION"] = sys.argv[5] if len(sys.argv) > 5 else ""

import torch  # noqa: E402
from engine_compare import same  # noqa: E402
from engine_load_vllm import vllm_loader  # noqa: E402


def pose_as_stage(pp_rank: int, pp: int) -> None:
    group = types.SimpleNamespace(rank_in_group=pp_rank, world_size=pp, is_first_rank=pp_rank == 0, is_last_rank=pp_rank == pp - 1)
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and mod is not None:
            if hasattr(mod, "get_pp_group"):
                mod.get_pp_group = lambda: group
            if hasattr(mod, "get_pipeline_model_parallel_rank"):
                mod.get_pipeline_model_parallel_rank = lambda: pp_rank


def main(model: str, export: str, tp: int, pp: int, ep: bool = False) -> int:
    build = vllm_loader(model, expert_parallel=ep, post_process=not ep)
    failed = 0
    for rank in range(pp * tp):
        pp_rank, tp_rank = divmod(rank, tp)

        def load(path: str, load_format: str) -> dict[str, torch.Tensor]:
            import vllm.model_executor.models  # noqa: F401 - the model modules bind get_pp_group at import

            pose_as_stage(pp_rank, pp)
            return {k: v.detach().clone() for k, v in build(tp_rank, tp, path, load_format).state_dict().items()}

        ref = load(model, "auto")
        try:
            got = load(export, "sharded_state")
        except Exception as e:  # what the engine says about a broken export is the result here
            print(f"pp {pp} x tp {tp} rank {rank} (stage {pp_rank}): vLLM refused the export: {type(e).__name__}: {str(e)[:300]}")
            failed += 1
            continue
        diff = sorted(k for k in ref.keys() | got.keys() if k not in ref or k not in got or not same(ref[k], got[k]))
        layers = sorted({int(k.split(".")[2]) for k in ref if k.startswith("model.layers.")})
        others = sorted(k for k in ref if not k.startswith("model.layers."))
        print(
            f"pp {pp} x tp {tp} rank {rank} (stage {pp_rank}): layers {layers[0]}-{layers[-1]}, {others}, {len(ref)} entries, "
            + ("bit-equal" if not diff else f"DIFFER: {diff[:4]}")
        )
        failed += bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6:7] == ["ep"]))
