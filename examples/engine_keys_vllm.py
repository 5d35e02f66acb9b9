"""Build vLLM's own model class for MODEL at tp TP posing as ranks R, load it with LOAD_FORMAT
("auto": vLLM slices the HF checkpoint; "sharded_state": an export), and print the key set its
sharded_state loader compares against (`_filter_subtensors(state_dict())`: name, dtype, shape); with
SAVE, torch.save each rank's tensors to SAVE-r{rank}.pt for a bit-for-bit comparison.

    python examples/engine_keys_vllm.py MODEL TP RANKS ep|no [SAVE [LOAD_FORMAT]]

Setup as examples/engine_load_vllm.py. process_weights_after_loading is skipped: vLLM's CPU MoE
post-processing needs its C ops (not in the CUDA wheel), and the files hold the pre-processing
layout anyway. `ep` sets --enable-expert-parallel. Used for docs/deploy.md (MoE and MLA)."""
import os, socket, sys, json
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
torch.accelerator.empty_cache = lambda: None
from vllm.config import LoadConfig, ModelConfig, VllmConfig, ParallelConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
model, tp, ranks, ep = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4] == "ep"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", enforce_eager=True))):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ensure_model_parallel_initialized(1, 1)
case = {"rank": 0, "size": 1}
import vllm.model_executor.model_loader.base_loader as bl
bl.process_weights_after_loading = lambda *a, **k: None  # CPU MoE post-processing needs vLLM's C ops; the files hold the pre-processing layout anyway
def pose():
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and mod is not None:
            if hasattr(mod, "get_tensor_model_parallel_rank"):
                mod.get_tensor_model_parallel_rank = lambda *a, **k: case["rank"]
            if hasattr(mod, "get_tensor_model_parallel_world_size"):
                mod.get_tensor_model_parallel_world_size = lambda *a, **k: case["size"]
out = {}
for r in ranks:
    case.update(rank=r, size=tp)
    mc = ModelConfig(model=model, dtype="bfloat16", enforce_eager=True)
    pc = ParallelConfig(enable_expert_parallel=ep)
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format=(sys.argv[6] if len(sys.argv) > 6 else "auto")), parallel_config=pc)
    with set_current_vllm_config(vc):
        pose()
        m = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
    sd = ShardedStateLoader._filter_subtensors(m.state_dict())
    out[r] = {k: [str(v.dtype), list(v.shape)] for k, v in sd.items()}
    torch.save({k: v.detach().clone() for k, v in sd.items()}, f"{sys.argv[5]}-r{r}.pt") if len(sys.argv) > 5 else None
print("JSON" + json.dumps(out))
