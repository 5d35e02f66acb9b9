"""Build vLLM's own model class for MODEL at tp TP posing as ranks R, load it with LOAD_FORMAT
("auto": vLLM slices the HF checkpoint; "sharded_state": an export), and print the key set its
sharded_state loader compares against (`_filter_subtensors(state_dict())`: name, dtype, shape); with
SAVE, torch.save each rank's tensors to SAVE-r{rank}.pt for a bit-for-bit comparison.

    python examples/engine_keys_vllm.py MODEL TP RANKS ep|no [SAVE [LOAD_FORMAT]]

Setup as examples/engine_load_vllm.py. process_weights_after_loading is skipped: vLLM's CPU MoE
post-processing needs its C ops (not in the CUDA wheel), and the files hold the pre-processing
layout anyway. `ep` sets --enable-expert-parallel. Used for docs/deploy.md (MoE and MLA)."""
import json
import sys

import torch
from engine_load_vllm import vllm_loader

from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

model, tp, ranks, ep = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4] == "ep"
build = vllm_loader(model, expert_parallel=ep, post_process=False)
out = {}
for r in ranks:
    m = build(r, tp, model, sys.argv[6] if len(sys.argv) > 6 else "auto")
    sd = ShardedStateLoader._filter_subtensors(m.state_dict())
    out[r] = {k: [str(v.dtype), list(v.shape)] for k, v in sd.items()}
    if len(sys.argv) > 5:
        torch.save({k: v.detach().clone() for k, v in sd.items()}, f"{sys.argv[5]}-r{r}.pt")
print("JSON" + json.dumps(out))
