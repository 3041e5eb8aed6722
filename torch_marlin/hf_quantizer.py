"""transformers integration: ``quant_method: "torch_marlin"``.

Importing this module registers :class:`TorchMarlinConfig` and :class:`TorchMarlinHfQuantizer`
through transformers' public ``register_quantization_config`` / ``register_quantizer``
(``import torch_marlin`` makes that happen as soon as transformers is imported, before or after
torch_marlin, without importing it itself; so does the first use of ``torch_marlin.TorchMarlinConfig``). Then:

* ``AutoModelForCausalLM.from_pretrained(dir)`` loads a checkpoint written by
  :func:`torch_marlin.save_quantized` or ``save_pretrained``: every layer named in the config's
  ``layers`` is an empty MarlinLinear / TrellisLinear on the meta device before transformers
  assigns its stored tensors, so no float weight of those layers is ever built;
* ``from_pretrained(float_dir, quantization_config=TorchMarlinConfig(format="u4", group_size=64))``
  loads the float weights, then quantizes every eligible Linear in place (round to nearest, as
  :func:`torch_marlin.patch_model`) and records the layers in the config;
* ``model.save_pretrained(dir)`` writes the quantized tensors and that config, so the directory
  loads back with the first path.
"""

import warnings
from typing import Dict, List, Optional

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = "torch_marlin"


class TorchMarlinConfig(QuantizationConfigMixin):
    """``format``: ``"fp4"``, ``"u4"`` (MarlinLinear) or ``"trellis"``; ``group_size`` along K;
    ``modules_to_not_convert``: Linear names kept in float (default ``["lm_head"]``; exact names,
    trailing components or globs as in :func:`torch_marlin.patch_model`); ``format_options``:
    the format's quantizer options (u4 ``symmetric``; trellis ``bits``, ``rotate``, ``seed``).
    ``layers``: per-layer entries of an already quantized model (written when saving; the same
    entries as ``torch_marlin.json``), which makes loading build those layers empty first."""

    def __init__(self, format: str = "fp4", group_size: int = 128, modules_to_not_convert: Optional[List[str]] = None,
                 format_options: Optional[dict] = None, layers: Optional[Dict[str, dict]] = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format = format
        self.group_size = group_size
        self.modules_to_not_convert = ["lm_head"] if modules_to_not_convert is None else list(modules_to_not_convert)
        self.format_options = dict(format_options or {})
        self.layers = dict(layers or {})
        self.post_init()

    def post_init(self):
        from .registry import layer_format, layer_format_for_entry

        try:
            layer_format(self.format).check_group_size(self.group_size)
        except ValueError as e:
            raise ValueError(f"TorchMarlinConfig: {e}") from None
        for name, entry in self.layers.items():
            try:
                layer_format_for_entry(entry)
            except ValueError as e:
                raise ValueError(f"TorchMarlinConfig: layers['{name}'] has {e}") from e


class TorchMarlinHfQuantizer(HfQuantizer):
    """Builds the quantized layers of a torch_marlin checkpoint before its tensors are loaded, or
    quantizes a float model's Linears after its weights are loaded."""

    requires_calibration = False
    #: Whether the model this quantizer loaded was loaded tensor-parallel (set after loading).
    loaded_tensor_parallel = False

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("torch_marlin layers cannot be offloaded to disk; pick a device_map without 'disk'")

    def _process_model_before_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            return model
        from .registry import empty_layer

        layers = self.quantization_config.layers
        if not layers:
            raise ValueError("quantization_config (torch_marlin) lists no layers: the checkpoint was not written by "
                             "torch_marlin.save_quantized or save_pretrained of a quantized model")
        for name, entry in layers.items():
            try:
                old = model.get_submodule(name)
            except AttributeError as e:
                raise ValueError(f"quantization_config names layer '{name}', which the model does not have") from e
            if (getattr(old, "in_features", None), getattr(old, "out_features", None)) != \
                    (entry.get("in_features"), entry.get("out_features")):
                raise ValueError(f"quantization_config: layer '{name}' is {entry.get('in_features')}->"
                                 f"{entry.get('out_features')}, the model has {type(old).__name__} there")
            model.set_submodule(name, empty_layer(entry, "meta"))
        return model

    def update_parallel_plan(self, model, plan):
        super().update_parallel_plan(model, plan)
        if _tensor_parallel(model):  # tp_plan: our layers get our styles (torch_marlin/distributed/hf.py)
            from .distributed import hf as tp_hf

            tp_hf.update_plan(model, plan, self._will_quantize, self.quantization_config.group_size)

    def _will_quantize(self, name, linear) -> bool:
        from .patching import _matches
        from .registry import layer_format

        cfg = self.quantization_config
        return not self.pre_quantized and _matches(name, cfg.modules_to_not_convert) is None and \
            layer_format(cfg.format).unsupported(linear.in_features, cfg.group_size) is None

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .patching import patch_model
        from .registry import checkpoint_entry, use_device_layouts

        cfg = self.quantization_config
        linears = {}
        self.loaded_tensor_parallel = _tensor_parallel(model)
        if self.loaded_tensor_parallel:
            from .distributed import hf as tp_hf

            linears = tp_hf.localize(model)
        if self.pre_quantized:
            use_device_layouts(model)
        else:
            report = patch_model(model, format=cfg.format, group_size=cfg.group_size,
                                 skip=cfg.modules_to_not_convert, progress=False, **cfg.format_options)
            if report.unsupported:
                warnings.warn(f"TorchMarlinConfig: {report.unsupported_warning()}", stacklevel=2)
        if linears:
            tp_hf.rehook(model, linears)
        cfg.layers = {name: entry for name, mod in model.named_modules()
                      if (entry := checkpoint_entry(mod)) is not None}
        return model

    def is_serializable(self):
        if self.loaded_tensor_parallel:
            warnings.warn("TorchMarlinConfig: this model was loaded tensor-parallel (tp_plan): each rank's quantized "
                          "layers hold its shards only, which save_pretrained would write as a smaller model; save "
                          "from a one-process model (docs/distributed.md)", stacklevel=2)
            return False
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def _tensor_parallel(model) -> bool:
    """Whether transformers is loading ``model`` tensor-parallel (``tp_plan`` under torchrun)."""
    import torch.distributed as dist

    config = getattr(getattr(model, "config", None), "distributed_config", None)
    return dist.is_available() and dist.is_initialized() and (getattr(config, "tp_size", 1) or 1) > 1


def register() -> None:
    """Registers the config and quantizer once (transformers refuses a second registration)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(TorchMarlinConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(TorchMarlinHfQuantizer)


register()
