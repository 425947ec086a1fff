"""Which weights of a K3-class checkpoint are stored in which format: what ``crescent plan`` counts.

A preset (``kimi-k3``, ``kimi-k3-nano``) is planned as ``--experts`` says (MXFP4 routed experts
by default, everything else bf16). A checkpoint directory is planned as it is stored:

- with a ``quantization_config`` (compressed-tensors ``mxfp4-pack-quantized``, K3's): every
  ``Linear`` weight its ``targets`` cover and its ``ignore`` list does not name is MXFP4
  (4.25 bits per weight) — the routed experts, and in K3 also the latent MoE's
  ``routed_expert_down_proj``/``routed_expert_up_proj`` and the dense MLPs; the rest (attention,
  shared experts, embeddings, norms, router) in the model's dtype;
- without one (Kimi-Linear): every weight in the model's dtype (the config's ``dtype``, else the
  shards' stored dtype, else bf16) — a bf16 Kimi-Linear is 98 GB, not the 29 GB an MXFP4 guess gives.

compressed-tensors' rules, as its ``ignore`` entries read: a ``re:`` entry is a regular
expression matched (``re.match``) against the module name, any other entry a module name or its
last components. Module names are the checkpoint's (``real_checkpoint.real_name``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crescent.services.plan.gpus import PlanInputError

# Bits per weight: element bits plus one 8-bit shared scale per 32 elements for the MX formats.
FORMAT_BITS = {"mxfp4": 4 + 8 / 32, "mxfp8": 8 + 8 / 32, "bf16": 16.0, "fp16": 16.0, "fp32": 32.0}
EXPERT_FORMATS = ("mxfp4", "mxfp8", "bf16")
_DTYPE_FORMATS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_NOT_LINEAR = ("embed_tokens.weight", "norm.weight", "layernorm.weight", "mlp.gate.weight", "conv1d.weight",
               "A_log", "dt_bias", "e_score_correction_bias", ".query")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """``quant``: the format of quantized weights (None: nothing is); ``plain``: everything else;
    ``all_linear``: every Linear not ignored is quantized (a checkpoint's quantization_config),
    else the routed experts only (a preset's ``--experts``); ``source``: where this was read."""

    quant: str | None
    plain: str
    all_linear: bool
    ignore: tuple[str, ...] = ()
    source: str = "--experts"

    @property
    def expert_format(self) -> str:
        return self.quant or self.plain

    def quantized(self, module: str, in_features: int, routed_expert: bool) -> bool:
        """Whether the weight of ``module`` (the checkpoint's name, no ``.weight``) is stored quantized."""
        if self.quant is None:
            return False
        if not self.all_linear:
            return routed_expert
        if module.endswith(_NOT_LINEAR) or (module + ".weight").endswith(_NOT_LINEAR) or in_features % 32:
            return False
        return not any(_ignored(module, entry) for entry in self.ignore)


def _ignored(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.endswith("." + entry)


def preset_format(experts: str | None) -> WeightFormat:
    fmt = experts or "mxfp4"
    if fmt not in EXPERT_FORMATS:
        raise PlanInputError(f"--experts {fmt!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    return WeightFormat(quant=None if fmt == "bf16" else fmt, plain="bf16", all_linear=False,
                        source=f"the preset's shape, routed experts as --experts {fmt}")


def checkpoint_format(raw: Mapping[str, Any], model_dtype: str) -> WeightFormat:
    """The stored format of a real or Crescent-format K3-class checkpoint's ``config.json``."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    quant = text.get("quantization_config", raw.get("quantization_config"))
    plain = _DTYPE_FORMATS.get(model_dtype, "bf16")
    if not quant:
        return WeightFormat(quant=None, plain=plain, all_linear=True, source="no quantization_config")
    method, fmt = quant.get("quant_method"), quant.get("format")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise PlanInputError(f"quantization_config {method!r}/{fmt!r}: plan reads compressed-tensors "
                             "mxfp4-pack-quantized (K3's)")
    targets = {t for group in (quant.get("config_groups") or {}).values() for t in group.get("targets", [])}
    if targets and targets != {"Linear"}:
        raise PlanInputError(f"quantization_config targets {sorted(targets)}: plan reads ['Linear']")
    return WeightFormat(quant="mxfp4", plain=plain, all_linear=True, ignore=tuple(quant.get("ignore") or ()),
                        source="quantization_config")


def directory_format(path: Path, raw: Mapping[str, Any], experts: str | None, model_dtype: str) -> WeightFormat:
    """A directory's format; ``--experts``, if given, must agree with it."""
    fmt = checkpoint_format(raw, model_dtype)
    if experts is not None and experts != fmt.expert_format:
        raise PlanInputError(f"--experts {experts}: {path / 'config.json'} stores its routed experts in "
                             f"{fmt.expert_format} ({fmt.source}); leave --experts out for a checkpoint")
    return fmt
