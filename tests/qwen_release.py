"""Qwen3.5-MoE / Qwen3-Next checkpoints in the form the releases ship (tests/test_qwen_release.py):
made from a transformers-saved tiny checkpoint by adding the MTP layer and / or storing the routed
experts fused, as the published safetensors name them and as SGLang's loaders read them.

- MTP (SGLang models/qwen3_5_mtp.py, qwen3_next_mtp.py): `mtp.fc.weight` [H, 2H],
  `mtp.pre_fc_norm_embedding.weight` / `mtp.pre_fc_norm_hidden.weight` / `mtp.norm.weight` [H], and
  one full-attention MoE decoder layer `mtp.layers.0.*` with the main full-attention layer's names
  (self_attn q/k/v/o, q/k norms, the two layer norms, router, experts, shared expert and its gate);
  transformers 5.24 saves none of them, so they are random here (seeded), in a file of their own.
- Fused experts (qwen3_5.py load_weights): per layer `mlp.experts.gate_up_proj` [E, 2I, H], each
  expert's [gate_proj; up_proj] rows (the loader's `chunk(2, dim=-2)`), and `mlp.experts.down_proj`
  [E, H, I], each expert's down_proj: the same numbers as the per-expert source.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from test_moe_split import source_tensors

_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every layer's per-expert gate/up/down replaced by gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    per: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for n, t in tensors.items():
        m = _EXPERT.fullmatch(n)
        if m is None:
            out[n] = t
        else:
            per.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for module, w in per.items():
        e = 1 + max(i for i, _ in w)
        out[f"{module}.gate_up_proj"] = torch.stack([torch.cat([w[(i, "gate_proj")], w[(i, "up_proj")]]) for i in range(e)]).contiguous()
        out[f"{module}.down_proj"] = torch.stack([w[(i, "down_proj")] for i in range(e)]).contiguous()
    return out


def mtp_tensors(tensors: dict[str, torch.Tensor], config: dict, seed: int = 7) -> dict[str, torch.Tensor]:
    """The MTP layer under the release's names: the last full-attention layer's tensor names and
    shapes at mtp.layers.0, plus fc and the three norms; random values, seeded."""
    text = config.get("text_config") or config
    types = text.get("layer_types") or []
    full = max(i for i, k in enumerate(types) if k == "full_attention")
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.") if any(n.startswith(p) for n in tensors))
    g = torch.Generator().manual_seed(seed)
    h = text["hidden_size"]
    ref = tensors[next(n for n in tensors if n.endswith("embed_tokens.weight"))]
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).to(ref.dtype)  # noqa: E731
    layer = {n[len(f"{prefix}{full}.") :]: t for n, t in tensors.items() if n.startswith(f"{prefix}{full}.")}
    out = {f"mtp.layers.0.{n}": rnd(*layer[n].shape) for n in sorted(layer)}  # the same numbers under either prefix
    out["mtp.fc.weight"] = rnd(h, 2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = rnd(h)
    return out


def released(src: Path, dst: Path, *, mtp: bool, fused: bool) -> Path:
    """`src` with the MTP layer added (its own file) and / or its experts fused; the configs copied."""
    dst.mkdir(parents=True)
    for f in src.glob("*.json"):
        if not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    tensors = source_tensors(src)
    extra = mtp_tensors(tensors, config) if mtp else {}
    files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": extra}
    if fused:
        files = {f: fuse_experts(t) for f, t in files.items()}
    files = {f: t for f, t in files.items() if t}
    weight_map = {}
    for f, t in files.items():
        save_file({n: x.contiguous() for n, x in t.items()}, dst / f, metadata={"format": "pt"})
        weight_map.update({n: f for n in t})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}))
    return dst
