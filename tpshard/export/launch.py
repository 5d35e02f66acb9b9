"""The engine's launch line for an export: the command that starts the engine in exactly the layout
that was exported (docs/deploy.md), every path and value quoted for a shell.

SGLang (sglang/srt/server_args.py): --tp-size, --pp-size, --attn-dp-size for attention DP,
--ep-size, --moe-dense-tp-size, --enable-dp-lm-head, --moe-a2a-backend, --dcp-size and
--dcp-replicate-q-proj (arg_groups/fields/parallel.py L52-58, L140-152). Attention DP is
--attn-dp-size in SGLang 0.5.23 (arg_groups/fields/parallel.py L81-90): the older `--dp-size N
--enable-dp-attention` is a deprecated spelling of it (server_args.py L416-424, resolved by
arg_groups/parallel_hook.py handle_deprecated_dp_attention L39-61, to be removed after 2026-12-31),
and --dp-size alone (alias --data-parallel-size, fields/parallel.py L73-80) starts independent
replicas of the whole model. vLLM (vllm/engine/arg_utils.py):
--tensor-parallel-size, --pipeline-parallel-size, --enable-expert-parallel (EP size = tp: the only
EP an export for vLLM has, tpshard.export.layout), --decode-context-parallel-size (a DeepSeek
--dcp split: tpshard.export.dcp), --language-model-only where every key is under `language_model.`
(Llama-4: the export holds no vision tower, which vLLM then builds none of: config/multimodal.py
MultiModalConfig.get_limit_per_prompt, models/interfaces.py _mark_tower_model). Both: --load-format sharded_state and --dtype of the exported
weights (another one is cast while loading).
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

from tpshard.export.manifest import ExportManifest
from tpshard.safetensors_format import nbytes_of

ENGINE_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def weights_dtype(manifest: ExportManifest) -> str | None:
    """The engine --dtype of the exported weights: the float dtype most of their bytes have
    (constants aside; by bytes, not by count: a quantized export has a float32 scale per linear,
    and DeepSeek a float32 e_score_correction_bias per layer)."""
    counts: Counter = Counter()
    for f in manifest.files:
        for t in f.tensors:
            if t.value is None and t.dtype in ENGINE_DTYPE:
                counts[t.dtype] += nbytes_of(t.dtype, t.shape)
    return ENGINE_DTYPE[counts.most_common(1)[0][0]] if counts else None


def language_model_only(manifest: ExportManifest) -> bool:
    """Every key of the export is the text model's of a multimodal class (`language_model.*`)."""
    names = [t.name for f in manifest.files for t in f.tensors]
    return bool(names) and all(n.startswith("language_model.") for n in names)


def launch_line(manifest: ExportManifest, dest: Path) -> str:
    """The shell command that starts manifest.engine on the export at `dest`."""
    topo, options = manifest.from_.topology, manifest.from_.options
    env = "".join(f"{k}={shlex.quote(str(v))} " for k, v in (dict(manifest.env) if manifest.env else {}).items())
    path = shlex.quote(str(dest))
    if manifest.engine == "vllm":
        flags = [f"--tensor-parallel-size {topo.tp}"]
        flags += [f"--pipeline-parallel-size {topo.pp}"] * (topo.pp > 1)
        flags += ["--enable-expert-parallel"] * (topo.ep > 1)
        flags += [f"--decode-context-parallel-size {topo.dcp}"] * bool(topo.dcp)  # UNSET (1) is falsy
        flags += ["--language-model-only"] * language_model_only(manifest)
        command = f"vllm serve {path} --load-format sharded_state"
    else:
        flags = [f"--tp-size {topo.tp}"]
        flags += [f"--pp-size {topo.pp}"] * (topo.pp > 1)
        flags += [f"--attn-dp-size {topo.attn_dp}"] * (topo.attn_dp > 1)
        flags += ["--enable-dp-lm-head"] * bool(options.dp_lm_head)
        flags += [f"--ep-size {topo.ep}"] * (topo.ep > 1)
        flags += [f"--moe-dense-tp-size {topo.moe_dense_tp}"] * (topo.moe_dense_tp is not None)
        flags += [f"--moe-a2a-backend {topo.moe_a2a_backend}"] * bool(topo.moe_a2a_backend)
        flags += [f"--dcp-size {topo.dcp}"] * bool(topo.dcp) + ["--dcp-replicate-q-proj"] * bool(topo.dcp_replicate_q_proj)
        command = f"python -m sglang.launch_server --model-path {path} --load-format sharded_state"
    dtype = weights_dtype(manifest)
    flags += [f"--dtype {dtype}"] * (dtype is not None)
    return env + " ".join([command, *flags])
